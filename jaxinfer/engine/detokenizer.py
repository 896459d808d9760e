"""Incremental detokenization that never splits a multi-byte UTF-8 character."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from jaxinfer.engine.scheduling.request import Request, RequestStatus


class IncrementalDetokenizer:
    """Text of one request's output so far; `DecodeStream` holds back incomplete bytes."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._token_ids: list[int] = []
        self.text = ""

    @property
    def num_tokens(self) -> int:
        """Tokens added so far."""
        return len(self._token_ids)

    def add(self, token_id: int) -> str:
        """Appends a token; returns the new text it completes (possibly empty)."""
        self._token_ids.append(token_id)
        delta = self._stream.step(self._tokenizer, token_id) or ""
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flushes bytes still held back (as U+FFFD where they never became valid UTF-8);
        afterwards `text` equals a one-shot decode of every token."""
        full = self._tokenizer.decode(
            self._token_ids, skip_special_tokens=self._skip_special_tokens
        )
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[str, int]:
    """The earliest stop string that ends within the last num_new_chars characters (so it may
    span earlier text, and token boundaries), and where it starts; ("", -1) if none."""
    best, best_index = "", -1
    for stop in stops:
        start = max(len(text) - num_new_chars - len(stop) + 1, 0)
        index = text.find(stop, start)
        if index != -1 and (best_index == -1 or index < best_index):
            best, best_index = stop, index
    return best, best_index


def detokenize(
    request: Request, detokenizer: IncrementalDetokenizer, scheduler, finished: list[Request]
) -> None:
    """Adds a request's new tokens to its text, one at a time, and ends it at the first
    stop string they complete (dropping the tokens after it: scheduler.stop)."""
    new_tokens = request.output_token_ids[detokenizer.num_tokens :]
    stops = request.sampling_params.stop
    ended = request.status.finished
    for index, token in enumerate(new_tokens):
        delta = detokenizer.add(token)
        last = index == len(new_tokens) - 1
        if not stops or not delta or (last and request.status is RequestStatus.FINISHED_STOPPED):
            continue
        stop, position = find_stop_string(detokenizer.text, len(delta), stops)
        if position >= 0:
            keep = position + len(stop) * request.sampling_params.include_stop_str_in_output
            detokenizer.text = detokenizer.text[:keep]
            request.truncate_output(detokenizer.num_tokens)
            scheduler.stop(request, stop)
            if not ended:
                finished.append(request)
            return
