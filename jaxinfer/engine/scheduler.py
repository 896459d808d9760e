"""Continuous batching at token level.

No prefill or decode phase: each step gives every request num_tokens - num_computed_tokens new
tokens, within max_num_seqs, the token budget, max_model_len and the free KV blocks. Running
requests go first, in arrival order, so a long prompt (chunked by the budget) never stalls them;
when the pool runs dry the latest-arrived running request is preempted and recomputed later.
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxinfer.config import SchedulerConfig
from jaxinfer.engine.kv_cache_manager import KVCacheManager
from jaxinfer.engine.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step: the first new token's position
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so its sample is kept."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]  # batch order
    num_scheduled_tokens: int
    preempted: tuple[str, ...]  # request ids sent back to the waiting queue this step


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for logging and the server's metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Sampled results of one step, on the host, one row per scheduled request."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0
        self._arrivals = 0

    def check_admissible(self, request: Request) -> None:
        """Raises ValueError for a request that could never complete."""
        prompt_len = request.num_prompt_tokens
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; max_model_len is "
                f"{self.config.max_model_len}, which leaves no room for output"
            )
        max_tokens = request.sampling_params.max_tokens
        longest = self.config.max_model_len if max_tokens is None else prompt_len + max_tokens
        longest = min(longest, self.config.max_model_len)
        capacity = self.kv.pool.num_blocks - 1
        if self.kv.blocks_for(longest) > capacity:
            raise ValueError(
                f"the request needs up to {longest} tokens of KV cache, more than the whole pool "
                f"({capacity} blocks of {self.kv.block_size})"
            )

    def add_request(self, request: Request) -> None:
        self.check_admissible(request)
        request.arrival_index = self._arrivals
        self._arrivals += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                # The lowest priority, latest arrival gives its blocks back; if it was already
                # scheduled in this step (a lower priority ahead of this one), so are its tokens.
                victim = max(self.running, key=lambda r: r.sort_key)
                victim_index = self.running.index(victim)
                if victim_index < index:
                    dropped = next(x for x in scheduled if x.request is victim)
                    scheduled.remove(dropped)
                    budget += dropped.num_new_tokens
                    index -= 1
                del self.running[victim_index]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
            index += 1

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)
            num_cached = len(hits) * self.kv.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            if self.kv.enable_prefix_caching:
                self.kv.record_prefix_lookup(request.num_tokens, num_cached)
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new

        return SchedulerOutput(
            scheduled=tuple(scheduled),
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted=tuple(preempted),
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)  # ahead of later arrivals
        self.num_preemptions += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, step_output: StepOutput
    ) -> tuple[list[Request], list[Request]]:
        """Advances each scheduled request; returns (requests with a new token, finished)."""
        updated, finished = [], []
        for row, item in enumerate(scheduler_output.scheduled):
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted meanwhile
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(request)
            if not item.samples:
                continue  # a prefill chunk that has not reached the end of the prompt
            request.append_output_token(step_output.token_ids[row])
            if step_output.logprobs[row] is not None:
                request.logprobs.append(step_output.logprobs[row])
            updated.append(request)
            status = self._stop_status(request)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return updated, finished

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.running.remove(request)
        self.kv.free(request)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.pool.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def abort(self, request: Request) -> None:
        """Drops a request at any stage and frees what it held."""
        if request.status.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED_ABORTED
