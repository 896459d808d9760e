"""A request's host-side state while the engine works on it."""

from __future__ import annotations

import dataclasses
import enum

from jaxinfer.outputs import RequestMetrics
from jaxinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence. The scheduler's only rule: bring num_computed_tokens up to num_tokens.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt.
        sampling_params: how to sample.
        eos_token_ids: the model's end-of-sequence tokens (ignored with ignore_eos).
        seed: the random stream of this request (the user's seed, or fresh entropy).
        priority: lower runs first (and is preempted last); equal priorities are FCFS.
        cache_salt: isolates this request's prefix-cache entries from other tenants'.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int
    metrics: RequestMetrics
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    arrival_index: int = 0  # tie-break of equal priorities: admission order
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full blocks
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_index)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
