"""Host-side token constraints of a request, as rows of llguidance's token bitmask.

A row (i32[W], W = ceil(V / 32), bit j of word i allows token 32 i + j) is filled for each
constrained request that samples in a step: its structured-output grammar (llguidance), its
multi-token bad words (the last token of a bad word is blocked after the rest), and its
min_tokens (end-of-sequence and stop tokens blocked until then).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams

MAX_SPEC_CHARS = 100_000  # longest schema, regex or grammar text accepted


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def clear_bits(row: np.ndarray, token_ids) -> None:
    """Disallows tokens in a bitmask row."""
    words = row.view(np.uint32)
    for token in token_ids:
        words[token >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (token & 31)))


def bias_row(params: SamplingParams, vocab_size: int, banned_ids: list[int]) -> np.ndarray | None:
    """The request's fixed additive bias f32[V] (logit_bias, -inf outside allowed_token_ids
    and on single-token bad words), or None when it has none."""
    if not params.logit_bias and params.allowed_token_ids is None and not banned_ids:
        return None
    row = np.zeros(vocab_size, np.float32)
    if params.allowed_token_ids is not None:
        row[:] = -np.inf
        row[list(params.allowed_token_ids)] = 0.0
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    row[banned_ids] = -np.inf
    return row


class GrammarCompiler:
    """Compiles structured-output specs to llguidance matchers, within llguidance's parser
    limits (lexer fuel, items per step, grammar size), so a hostile spec fails fast.

    Thread-safe. Each spec is compiled once into a template matcher (validated, its lexer
    built by a first mask) kept in a small LRU cache with the errors of invalid specs; each
    request gets a copy of the template (`deep_copy` shares the compiled grammar)."""

    CACHE_SIZE = 64

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos_token_ids
        )
        # Default limits, but a fifth of the initial lexer fuel: measured here, 1M (the
        # default) let one hostile regex hold the engine for about a second.
        self.limits = llguidance.LLParserLimits(initial_lexer_fuel=200_000)
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher | str] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and metrics

    def grammar(self, spec: StructuredOutputsParams) -> str:
        texts = [spec.json if isinstance(spec.json, str) else None, spec.regex, spec.grammar]
        texts += list(spec.choice or ())
        if sum(len(t) for t in texts if t) > MAX_SPEC_CHARS:
            raise ValueError(f"the structured-output spec is longer than {MAX_SPEC_CHARS} chars")
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else {"type": "object"}
            if isinstance(schema, dict) and len(json.dumps(schema)) > MAX_SPEC_CHARS:
                raise ValueError(f"the JSON schema is longer than {MAX_SPEC_CHARS} chars")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": False}
                )
            except (ValueError, TypeError) as error:
                raise ValueError(f"invalid JSON schema: {error}") from None
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.LLMatcher.grammar_from_regex(
                "|".join(f"(?:{re.escape(c)})" for c in spec.choice)
            )
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)

    def template(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled matcher of `spec`, never advanced (copy it to use it); ValueError (for
        this request alone) if the spec is invalid."""
        grammar = self.grammar(spec)
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
        if cached is None:
            cached = self._compile(grammar)
            with self._lock:
                self.num_compiled += 1
                self._cache[grammar] = cached
                while len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise ValueError(cached)
        return cached

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher of its own for one request."""
        return self.template(spec).deep_copy()

    def _compile(self, grammar: str) -> llguidance.LLMatcher | str:
        """The template matcher, or the error message of an invalid grammar."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error and not error.startswith("WARNING"):
            return f"invalid structured-output spec: {error}"
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, limits=self.limits, log_level=0)
        if not matcher.is_error():
            # The first mask builds the lexer; a spec past the limits fails here, at admission.
            scratch = np.zeros((1, bitmask_width(self.tokenizer.vocab_size)), np.int32)
            llguidance.numpy.fill_next_token_bitmask(matcher, scratch, 0)
        if matcher.is_error():
            return f"invalid structured-output spec: {matcher.get_error()}"
        return matcher


class BadWords:
    """Multi-token bad words as a table: after a word's leading tokens, its last token is
    blocked. A step looks up each distinct prefix length once, so its cost does not grow with
    the number of words."""

    def __init__(self, sequences: list[list[int]]):
        self.by_prefix_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for sequence in sequences:
            if len(sequence) > 1:
                table = self.by_prefix_length.setdefault(len(sequence) - 1, {})
                table.setdefault(tuple(sequence[:-1]), []).append(sequence[-1])

    def __bool__(self) -> bool:
        return bool(self.by_prefix_length)

    def banned_after(self, output_ids: list[int]) -> list[int]:
        """The tokens that would complete a bad word after `output_ids`."""
        banned: list[int] = []
        for length, table in self.by_prefix_length.items():
            if length <= len(output_ids):
                banned += table.get(tuple(output_ids[len(output_ids) - length :]), ())
        return banned


def stop_mask(stop_ids: list[int], vocab_size: int) -> np.ndarray:
    """A bitmask row (i32[W]) allowing every token but `stop_ids`."""
    row = np.full(bitmask_width(vocab_size), -1, np.int32)
    clear_bits(row, stop_ids)
    return row


class RequestConstraints:
    """The per-step constraints of one request (None fields are unused). The bad words and
    the stop mask are shared by the samples of one request; the matcher is each sample's own.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher | None,
        bad_words: BadWords | None,
        min_tokens: int,
        stop_mask: np.ndarray | None,
        reasoning_end: int | None = None,
    ):
        self.matcher = matcher
        self.bad_words = bad_words if bad_words else None
        self.min_tokens = min_tokens
        self.stop_mask = stop_mask  # i32[W], applied while output_position < min_tokens
        # The token that ends the output's reasoning block, while it is still open: until it
        # is sampled the grammar neither masks nor consumes (EngineOptions.reasoning_parser).
        self.reasoning_end = reasoning_end if matcher is not None else None

    @property
    def depends_on_tokens(self) -> bool:
        """True when a step's row depends on the tokens sampled before it (so the step cannot
        be scheduled before they reach the host)."""
        return self.matcher is not None or self.bad_words is not None

    def active(self, output_position: int) -> bool:
        return self.depends_on_tokens or output_position < self.min_tokens

    def fill(
        self, bitmask: np.ndarray, index: int, output_ids: list[int], output_position: int
    ) -> None:
        """Writes row `index` of bitmask (i32[U, W], preset to all-allowed)."""
        row = bitmask[index]
        if self.matcher is not None and self.reasoning_end is None:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, index)
        if self.bad_words is not None:
            clear_bits(row, self.bad_words.banned_after(output_ids))
        if output_position < self.min_tokens and self.stop_mask is not None:
            row &= self.stop_mask

    def accept(self, token_id: int) -> None:
        if self.reasoning_end is not None:
            if token_id == self.reasoning_end:
                self.reasoning_end = None  # the grammar starts with the next token
        elif self.matcher is not None:
            self.matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        """Why the grammar failed mid-generation (a limit reached on a later mask), if it did."""
        if self.matcher is not None and self.matcher.is_error():
            return f"structured output failed: {self.matcher.get_error()}"
        return None

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return self.matcher is not None and self.matcher.is_stopped()


def step_bitmask(
    request, output_position: int, drafts: tuple[int, ...], vocab_size: int
) -> np.ndarray | None:
    """The tokens the request's grammar (or multi-token bad words, or min_tokens) allows
    at `output_position` and after each proposal (i32[1 + D, W]), or None where nothing is
    constrained. The grammar advances over the proposals it accepts and is rolled back;
    the row after the first proposal it forbids (which that row's sample then cannot
    equal) and the rows past it allow everything."""
    constraints = request.constraints
    if constraints is None or not any(
        constraints.active(output_position + j) for j in range(len(drafts) + 1)
    ):
        return None
    if constraints.depends_on_tokens:
        assert request.num_output_placeholders == 0, "a sampled token is still in flight"
    values = np.full((len(drafts) + 1, bitmask_width(vocab_size)), -1, np.int32)
    outputs = request.output_token_ids
    consumed = 0
    reasoning_end = constraints.reasoning_end  # restored below: the drafts are not accepted
    try:
        for j in range(len(drafts) + 1):
            if constraints.active(output_position + j):
                constraints.fill(values, j, outputs + list(drafts[:j]), output_position + j)
            if j == len(drafts) or not _allows(values[j], drafts[j]):
                break
            if constraints.reasoning_end is not None:  # the grammar waits (see __init__)
                constraints.accept(drafts[j])
            elif constraints.matcher is not None:
                matcher = constraints.matcher
                if matcher.is_stopped() or not matcher.consume_token(drafts[j]):
                    break
                consumed += 1
    finally:
        constraints.reasoning_end = reasoning_end
    if consumed:
        constraints.matcher.rollback(consumed)
    return values


def _allows(row: np.ndarray, token: int) -> bool:
    """Whether a bitmask row (i32[W]) allows `token`."""
    return bool((int(row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)
