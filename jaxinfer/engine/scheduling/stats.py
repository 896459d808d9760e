"""The scheduler's counts: a snapshot for logging and the server's metrics, and speculative
decoding's acceptance."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for logging and the server's metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    num_generated_tokens: int  # sampled tokens kept, of every request (finished or not)
    spec: SpecStats | None = None  # speculative decoding's counts (None when it is off)
    # Each kind of cache entry: the fraction in use and how many there are
    # (KVCacheManager.usage and capacity: "kv_blocks", "recurrent_states" for a hybrid).
    cache_usage: dict[str, float] = dataclasses.field(default_factory=dict)
    cache_capacity: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SpecStats:
    """Counts of speculative decoding since the start."""

    num_drafts: int = 0  # request steps that verified at least one proposal
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # of which accepted
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # by index
    proposing_seconds: float = 0.0  # host lookups or the draft's steps (set by the engine)
    suffix_cache_entries: int = 0  # suffix decoding's server index (set by the engine)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> SpecStats:
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))
