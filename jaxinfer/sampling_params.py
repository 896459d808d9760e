"""Per-request sampling parameters, with vLLM's (and OpenAI's) names and meaning.

Every field is validated on creation; a value out of range is a ValueError naming the field,
and an unknown keyword (best_of included) is an error rather than something ignored. The
ranges keep every value that reaches a float32 or int32 array of the step finite and in range,
and every per-step host cost bounded (stop strings, bad words).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

MAX_LOGPROBS = 20  # like OpenAI's top_logprobs limit
MAX_N = 128
MIN_TEMPERATURE = 1e-6  # a positive temperature below this would overflow float32 logits
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_STRINGS = 64  # each is searched for at every step
MAX_STOP_CHARS = 512  # per stop string: a stream holds back up to this many characters
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256


def _param(default, *, body: Any = None, flag: str | None = None):
    """A SamplingParams field and where else it is spoken: `body`, its type in request bodies
    (the server's and batch lines', which pass it through by name: jaxinfer.server.protocol);
    `flag`, the help of the batch runner's command-line flag of that name
    (jaxinfer.run_batch). Declared here once, so a new parameter is one edit here (plus its
    sampler code)."""
    return dataclasses.field(default=default, metadata={"body": body, "flag": flag})


def body_fields() -> dict[str, Any]:
    """SamplingParams fields a request body passes through by name, with their body types."""
    return {
        f.name: f.metadata["body"]
        for f in dataclasses.fields(SamplingParams)
        if f.metadata.get("body") is not None
    }


def flag_fields() -> dict[str, tuple[type | str, str]]:
    """SamplingParams fields the batch runner takes as flags: (int, float, bool, or
    "multi_string" for a list of strings; help)."""
    fields = {}
    for f in dataclasses.fields(SamplingParams):
        if f.metadata.get("flag") is None:
            continue
        kind = f.metadata["body"] or type(f.default)
        fields[f.name] = ("multi_string" if kind == str | list[str] else kind, f.metadata["flag"])
    return fields


class RequestOutputKind(enum.Enum):
    """What the engine reports for a request at each step (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far, at every step
    DELTA = "delta"  # only what is new since the last report (streams)
    FINAL_ONLY = "final_only"  # one report, when the request finishes


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains the output to a language; exactly one field is set.

    Args:
        json: a JSON schema (dict or its text): the output is one JSON value that validates.
        json_object: any JSON object.
        regex: the output matches the regular expression in full.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar (llguidance's dialect).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured outputs json must be a schema (dict or JSON text)")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured outputs json is not valid JSON: {error}") from None
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs choice must be a list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    Args:
        n: independent samples of the same prompt (they share the prompt's KV blocks).
        temperature: 0 is greedy (argmax); otherwise in [1e-6, 100], dividing the logits
            before a random draw.
        top_p: sample from the smallest set of tokens whose probability reaches top_p (0, 1].
        top_k: sample from the k most likely tokens; 0, -1 or k >= the vocabulary means all.
        min_p: drop tokens less likely than min_p times the most likely one, [0, 1].
        repetition_penalty: in [0.01, 100]; divides positive (multiplies negative) logits of
            tokens seen in the prompt or the output; 1 is off.
        presence_penalty: [-2, 2], subtracted from the logits of tokens in the output.
        frequency_penalty: [-2, 2], times each token's count in the output, subtracted.
        logit_bias: token id -> bias in [-100, 100], added to the logits.
        allowed_token_ids: only these tokens may be sampled.
        bad_words: words that must not be generated (their token sequences are blocked, as
            vLLM does: the last token of each, after the rest); at most 1024 of up to 256
            characters.
        min_tokens: the end-of-sequence and stop tokens are suppressed until this many tokens
            have been generated.
        max_tokens: most tokens to generate; None runs until a stop or max_model_len.
        stop: strings that end the output; found across token boundaries and left out of
            the text unless include_stop_str_in_output; at most 64 of up to 512 characters.
        stop_token_ids: tokens that end the output (kept in token_ids, finish_reason "stop").
        include_stop_str_in_output: keep the stop string at the end of the text.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        seed: makes this request's draws reproducible whatever else is in the batch.
        logprobs: for each output token, the log-probabilities of the top N tokens and of the
            sampled one (N <= 20), from the model's distribution before any processing.
        prompt_logprobs: the same for every prompt token after the first.
        skip_special_tokens: leave special tokens out of the returned text.
        structured_outputs: constrain the output (json schema, json object, regex, choice,
            Lark grammar).
        output_kind: what each engine step reports for the request (cumulative outputs,
            deltas, or only the final output).
        num_speculative_tokens: with speculative decoding on, the most tokens proposed for
            this request per step (0: none); unset: the engine's num_speculative_tokens.
    """

    n: int = _param(1, body=int, flag="Completions per prompt.")
    temperature: float = _param(1.0, body=float, flag="0 is greedy.")
    top_p: float = _param(1.0, body=float, flag="Nucleus sampling mass.")
    top_k: int = _param(0, body=int, flag="Sample among the k likeliest tokens.")
    min_p: float = _param(
        0.0, body=float, flag="Drop tokens below min_p times the top probability."
    )
    repetition_penalty: float = _param(
        1.0, body=float, flag="Repetition penalty (prompt and output)."
    )
    presence_penalty: float = _param(0.0, body=float, flag="OpenAI presence penalty.")
    frequency_penalty: float = _param(0.0, body=float, flag="OpenAI frequency penalty.")
    logit_bias: Mapping[int, float] | None = None  # bodies: string keys (protocol.py)
    allowed_token_ids: Sequence[int] | None = _param(None, body=list[int])
    bad_words: Sequence[str] | None = _param(None, body=list[str])
    min_tokens: int = _param(0, body=int)
    max_tokens: int | None = _param(16, flag="Most generated tokens per prompt.")  # per endpoint
    stop: Sequence[str] | str | None = _param(
        None, body=str | list[str], flag="Stop string (repeatable)."
    )
    stop_token_ids: Sequence[int] = _param((), body=list[int])
    include_stop_str_in_output: bool = _param(False, body=bool)
    ignore_eos: bool = _param(
        False, body=bool, flag="Keep generating past the end-of-sequence token."
    )
    seed: int | None = _param(None, body=int, flag="Seed for sampled completions.")
    logprobs: int | None = None  # bodies: per endpoint (protocol.py)
    prompt_logprobs: int | None = _param(None, body=int)
    skip_special_tokens: bool = _param(True, body=bool)
    structured_outputs: StructuredOutputsParams | None = None  # bodies: a dict (protocol.py)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_speculative_tokens: int | None = _param(None, body=int)
    best_of: None = None  # refused: vLLM v1 dropped it too; use n

    def __post_init__(self):
        if self.best_of is not None:
            raise ValueError("best_of is not supported; ask for n samples instead")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids or ())))
        if isinstance(self.stop, str):
            set_("stop", (self.stop,))
        set_("stop", tuple(self.stop or ()))
        set_("bad_words", tuple(dict.fromkeys(self.bad_words or ())))
        if self.allowed_token_ids is not None:
            set_("allowed_token_ids", tuple(dict.fromkeys(self.allowed_token_ids)))
        if self.logit_bias is not None:
            try:
                set_("logit_bias", {int(k): float(v) for k, v in dict(self.logit_bias).items()})
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids to numbers") from None
        if isinstance(self.structured_outputs, Mapping):
            set_("structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        self._validate()

    def _validate(self) -> None:
        _integer("n", self.n, 1, MAX_N)
        _number("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                f"got {self.temperature!r}"
            )
        _number("top_p", self.top_p, 0, 1)
        if self.top_p <= 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _integer("top_k", self.top_k, -1, None)
        _number("min_p", self.min_p, 0, 1)
        _number(
            "repetition_penalty",
            self.repetition_penalty,
            MIN_REPETITION_PENALTY,
            MAX_REPETITION_PENALTY,
        )
        _number("presence_penalty", self.presence_penalty, -2, 2)
        _number("frequency_penalty", self.frequency_penalty, -2, 2)
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not -100 <= bias <= 100 or math.isnan(bias):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for token in self.allowed_token_ids:
                _integer("allowed_token_ids entries", token, 0, None)
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        _bounded_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
        _integer("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1, None)
            if self.min_tokens > self.max_tokens:
                raise ValueError(
                    f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
                )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        _bounded_strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_CHARS)
        for token in self.stop_token_ids:
            _integer("stop_token_ids entries", token, 0, None)
        if self.seed is not None:
            _integer("seed", self.seed, 0, 2**64 - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.num_speculative_tokens is not None:
            _integer("num_speculative_tokens", self.num_speculative_tokens, 0, None)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError("structured_outputs must be StructuredOutputsParams or a dict")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an n > 1 request: n = 1, the seed + index (when
        seeded), and prompt logprobs for the first sample only. Not validated again (these
        were): the engine thread builds up to 128 of them per request."""
        sample = copy.copy(self)
        object.__setattr__(sample, "n", 1)
        if self.seed is not None:
            object.__setattr__(sample, "seed", (self.seed + index) % 2**64)
        if index:
            object.__setattr__(sample, "prompt_logprobs", None)
        return sample

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def top_k_or_all(self, vocab_size: int) -> int:
        """top_k with 'all' (-1, 0 or the whole vocabulary and beyond) as 0."""
        return self.top_k if 0 < self.top_k < vocab_size else 0


def _integer(name: str, value, low: int, high: int | None) -> None:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _bounded_strings(name: str, values: tuple[str, ...], count: int, chars: int) -> None:
    if len(values) > count:
        raise ValueError(f"{name} takes at most {count} strings, got {len(values)}")
    longest = max(map(len, values), default=0)
    if longest > chars:
        raise ValueError(f"{name} strings must be at most {chars} characters, got {longest}")


def _number(name: str, value, low: float, high: float | None) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or (isinstance(value, float) and not math.isfinite(value))
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")
