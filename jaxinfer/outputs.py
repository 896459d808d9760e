"""What generate() returns, shaped like vLLM's RequestOutput."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)  # seconds

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first being scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token: top-N ids and the sampled one
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per token the
    # top-N ids and the token itself, as for output logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # An embedding request's vector (PoolingParams), once it has finished: f32[E].
    embedding: np.ndarray | None = None


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One DELTA output holding what several consecutive ones of a request reported."""
    pieces: dict[int, list[CompletionOutput]] = {}
    for output in outputs:
        for completion in output.outputs:
            pieces.setdefault(completion.index, []).append(completion)
    merged = []
    for index, parts in sorted(pieces.items()):
        logprobs = None
        if parts[0].logprobs is not None:
            logprobs = [entry for part in parts for entry in part.logprobs]
        merged.append(
            CompletionOutput(
                index=index,
                text="".join(part.text for part in parts),
                token_ids=[token for part in parts for token in part.token_ids],
                logprobs=logprobs,
                finish_reason=parts[-1].finish_reason,
                stop_reason=parts[-1].stop_reason,
            )
        )
    prompt_logprobs = next(
        (o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None
    )
    return dataclasses.replace(outputs[-1], outputs=merged, prompt_logprobs=prompt_logprobs)
