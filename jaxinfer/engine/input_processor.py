"""Turns a prompt and its SamplingParams into a PreparedRequest, off the engine thread.

Everything whose cost grows with the request's input happens here: tokenizing (in calls that
release the GIL), checking token ids against the vocabulary and the request against the
engine's limits, tokenizing bad words, building the logit-bias row, compiling the grammar
(cached by spec). The engine thread then only admits the result, which is cheap whatever the
request holds; the samples of an n > 1 request share everything prepared here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import llguidance
import numpy as np

from jaxinfer.engine.sampling.constraints import BadWords, GrammarCompiler, bias_row, stop_mask
from jaxinfer.engine.scheduling.lora_slots import SlotAdapter
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.tokenizer import TokenizerWrapper


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedRequest:
    """A request checked and made ready for admission (`LLMEngine.add_prepared`).

    Args:
        prompt: the prompt text, or None when given as token ids.
        prompt_token_ids: the prompt's tokens.
        params: how to sample.
        bias: f32[V] (read-only), the fixed logit bias (logit_bias, allowed_token_ids,
            single-token bad words), or None.
        bad_words: the multi-token bad words, or None.
        stop_mask: i32[W] (read-only), the bitmask row that blocks end-of-sequence and stop
            tokens while min_tokens is not reached, or None without min_tokens.
        grammar: the compiled structured-output matcher, never advanced: each sample takes a
            copy.
        stop_token_ids: the request's stop tokens, for membership tests at every step.
        pooling: an embedding request's pooling (its sample is not reported), or None.
        lora: its LoRA adapter, ready for a device slot (jaxinfer.engine.lora_adapters).
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    bias: np.ndarray | None
    bad_words: BadWords | None
    stop_mask: np.ndarray | None
    grammar: llguidance.LLMatcher | None
    stop_token_ids: frozenset[int]
    pooling: PoolingParams | None = None
    lora: SlotAdapter | None = None  # the LoRA adapter it runs with


class InputProcessor:
    """Prepares requests; thread-safe, so several requests can be prepared at once.

    Args:
        tokenizer: the model's tokenizer.
        tokenizer_json: its file, for the grammar compiler (built on first use).
        vocab_size: the model's vocabulary (token ids must be below it).
        eos_token_ids: end-of-sequence tokens (blocked with stop tokens under min_tokens).
        check_admissible: raises ValueError for a (prompt length, params) the engine could
            never serve.
    """

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        check_admissible: Callable[[int, SamplingParams], None],
    ):
        self.tokenizer = tokenizer
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.check_admissible = check_admissible
        self._grammar_compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use (it indexes the whole vocabulary)."""
        with self._lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer_json, self.vocab_size, sorted(self.eos_token_ids)
                )
            return self._grammar_compiler

    def compile_grammar(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The spec's compiled matcher (cached); ValueError for an invalid spec."""
        return self.grammar_compiler.template(spec)

    def prepare(
        self, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True
    ) -> PreparedRequest:
        """Raises ValueError (TypeError for a prompt of the wrong type) for a request that
        could never be served."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        vocab = self.vocab_size
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens)
        elif isinstance(prompt, list | tuple | np.ndarray):
            text = None
            ids = np.asarray(prompt)
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError("a prompt of token ids must be a flat list of integers")
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            token_ids = ids.astype(np.int64).tolist()
        else:
            raise TypeError(f"a prompt is text or token ids, not {type(prompt).__name__}")
        self.check_admissible(len(token_ids), params)
        for name, ids in [
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("logit_bias", (params.logit_bias or {}).keys()),
        ]:
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} has token ids beyond the vocabulary ({vocab})")
        sequences = self.bad_word_sequences(params.bad_words)
        bias = bias_row(params, vocab, [s[0] for s in sequences if len(s) == 1])
        stop_ids = sorted(set(params.stop_token_ids) | self.eos_token_ids)
        mask = stop_mask(stop_ids, vocab) if params.min_tokens else None
        grammar = (
            self.compile_grammar(params.structured_outputs)
            if params.structured_outputs is not None
            else None
        )
        for array in (bias, mask):
            if array is not None:
                array.setflags(write=False)  # shared by the samples
        bad_words = BadWords(sequences)
        return PreparedRequest(
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            bias=bias,
            bad_words=bad_words if bad_words else None,
            stop_mask=mask,
            grammar=grammar,
            stop_token_ids=frozenset(params.stop_token_ids),
        )

    def bad_word_sequences(self, bad_words: tuple[str, ...]) -> list[list[int]]:
        """Token sequences of each bad word, as written and after a space (vLLM's rule),
        without repeats."""
        texts = [t for word in bad_words for t in (word.lstrip(), " " + word.lstrip())]
        unique = dict.fromkeys(
            tuple(ids) for ids in self.tokenizer.encode_many(texts, add_special_tokens=False)
        )
        return [list(ids) for ids in unique if ids]
