"""Incremental detokenization that never splits a multi-byte UTF-8 character."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Text of one request's output so far; `DecodeStream` holds back incomplete bytes."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Appends a token; returns the new text it completes (possibly empty)."""
        delta = self._stream.step(self._tokenizer, token_id) or ""
        self.text += delta
        return delta
