"""Per-request sampling parameters, with vLLM's names and meaning."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # like OpenAI's top_logprobs limit


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    Args:
        temperature: 0 is greedy (argmax); above 0 scales the logits before a random draw.
        max_tokens: most tokens to generate; None runs until a stop or max_model_len.
        stop_token_ids: tokens that end the output (kept in token_ids, finish_reason "stop").
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        seed: makes this request's draws reproducible whatever else is in the batch.
        logprobs: for each output token, the log-probabilities of the top N tokens and of the
            sampled one (N <= 20).
        skip_special_tokens: leave special tokens out of the returned text.
    """

    temperature: float = 1.0
    max_tokens: int | None = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers: {self.stop_token_ids}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
