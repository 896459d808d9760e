"""Continuous batching at token level.

No prefill or decode phase: each step gives every request num_tokens - num_computed_tokens new
tokens, within max_num_seqs, the token budget, max_model_len and the free KV blocks. Running
requests go first, in arrival order, so a long prompt (chunked by the budget) never stalls them;
when the pool runs dry the latest-arrived running request is preempted and recomputed later.

A step is applied to the requests when it is scheduled: num_computed_tokens advances and each
request that samples gains an output placeholder. update_from_output later fills the
placeholders with the sampled tokens and applies stops. So the engine may schedule step N+1
while step N runs on the device (async scheduling): a decode's input token is then step N's
placeholder, read on the device; the results of steps that a preemption or abort overtook are
dropped.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxinfer.config import SchedulerConfig
from jaxinfer.engine.constraints import bitmask_width
from jaxinfer.engine.kv_cache_manager import KVCacheManager
from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.engine.step import RowInit, ScheduledRequest, SchedulerOutput, StepOutput


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


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, vocab_size: int = 0
    ):
        """`vocab_size`: the width of grammar bitmask rows (requests with constraints)."""
        self.config = config
        self.kv = kv_cache_manager
        self.vocab_size = vocab_size
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # in admission order
        self._running_ids: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self._arrivals = 0
        self._admissions = 0  # each admission's epoch: a stale step's rows never match
        self._released: list[str] = []  # ids that left the running set since the last step

    def check_admissible(self, prompt_len: int, max_tokens: int | None) -> None:
        """Raises ValueError for a request that could never complete (it reads only the
        configuration, so any thread may call it)."""
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; max_model_len is "
                f"{self.config.max_model_len}, which leaves no room for output"
            )
        longest = self.config.max_model_len if max_tokens is None else prompt_len + max_tokens
        longest = min(longest, self.config.max_model_len)
        capacity = self.kv.pool.num_blocks - 1
        if self.kv.blocks_for(longest) > capacity:
            raise ValueError(
                f"the request needs up to {longest} tokens of KV cache, more than the whole pool "
                f"({capacity} blocks of {self.kv.block_size})"
            )

    def add_request(self, request: Request) -> None:
        self.check_admissible(request.num_prompt_tokens, request.sampling_params.max_tokens)
        request.arrival_index = self._arrivals
        self._arrivals += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []  # (request, new tokens)
        preempted: list[str] = []

        admitted: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(
                request.num_tokens_with_placeholders - request.num_computed_tokens, budget
            )
            if num_new <= 0 or self._sampled_enough(request):
                index += 1  # its in-flight step finishes it, or there is nothing to compute
                continue
            while not self.kv.allocate_blocks(request, num_new):
                # The lowest priority, latest arrival gives its blocks back; if it was already
                # scheduled in this step (a lower priority ahead of this one), so are its tokens.
                victim = max(self.running, key=lambda r: r.sort_key)
                victim_index = self.running.index(victim)
                if victim_index < index:
                    dropped = next((x for x in scheduled if x[0] is victim), None)
                    if dropped is not None:
                        scheduled.remove(dropped)
                        budget += dropped[1]
                    index -= 1
                del self.running[victim_index]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            scheduled.append((request, num_new))
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
            if not self.kv.allocate_blocks(request, num_new, hits):
                break
            if self.kv.enable_prefix_caching:
                self.kv.record_prefix_lookup(request.num_tokens, num_cached)
                # Admitted now, never preempted in this step: its prompt blocks can be shared
                # at once (the n samples of one prompt, prompts arriving together).
                self.kv.cache_full_blocks(request, request.num_computed_tokens + num_new)
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            request.epoch = self._admissions
            self._admissions += 1
            self.running.append(request)
            self._running_ids[request.request_id] = request
            admitted.add(request.request_id)
            scheduled.append((request, num_new))
            budget -= num_new

        released = ()
        if scheduled:  # (an empty output is never built: the rows wait for the next one)
            released, self._released = tuple(self._released), []
        return SchedulerOutput(
            scheduled=tuple(
                self._apply(request, num_new, request.request_id in admitted)
                for request, num_new in scheduled
            ),
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted=tuple(preempted),
            released=released,
        )

    def _sampled_enough(self, request: Request) -> bool:
        """True when the steps in flight already sample the request's last token."""
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return (max_tokens is not None and num_outputs >= max_tokens) or (
            request.num_tokens_with_placeholders >= self.config.max_model_len
        )

    def _apply(self, request: Request, num_new: int, admitted: bool) -> ScheduledRequest:
        """Advances the request by a scheduled step (before the step runs) and describes the
        step's part for it."""
        first = request.num_computed_tokens
        samples = first + num_new == request.num_tokens_with_placeholders
        output_position = request.num_output_tokens + request.num_output_placeholders
        params = request.sampling_params
        row_init = None
        if admitted:
            row_init = RowInit(
                token_ids=tuple(request.all_token_ids) if params.uses_penalties else None,
                num_prompt_tokens=request.num_prompt_tokens,
                bias=request.bias,
            )
        item = ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=first,
            num_new_tokens=num_new,
            token_ids=tuple(request.all_token_ids[first : first + num_new]),
            block_ids=tuple(request.block_ids),
            samples=samples,
            output_position=output_position,
            epoch=request.epoch,
            params=params,
            seed=request.seed,
            has_bias=request.bias is not None,
            prompt_token_ids=request.prompt_token_ids,
            bitmask=self._bitmask(request, output_position) if samples else None,
            row_init=row_init,
        )
        request.num_computed_tokens = first + num_new
        if samples:
            request.num_output_placeholders += 1
        return item

    def _bitmask(self, request: Request, output_position: int) -> np.ndarray | None:
        """The tokens the request's grammar (or multi-token bad words) allows for the sample
        at `output_position`, or None where nothing is constrained."""
        constraints = request.constraints
        if constraints is None or not constraints.active(output_position):
            return None
        if constraints.depends_on_tokens:
            assert request.num_output_placeholders == 0, "a sampled token is still in flight"
        values = np.full((1, bitmask_width(self.vocab_size)), -1, np.int32)
        constraints.fill(values, 0, request.output_token_ids, output_position)
        return values[0]

    def _release(self, request: Request) -> None:
        """Gives back everything a request holds that leaves the running set (its device row
        goes with the next step's SchedulerOutput.released)."""
        self.kv.free(request)
        del self._running_ids[request.request_id]
        self._released.append(request.request_id)
        request.num_output_placeholders = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)  # ahead of later arrivals
        self.num_preemptions += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, step_output: StepOutput
    ) -> tuple[list[Request], list[Request]]:
        """Fills each sampling request's oldest placeholder with its token and applies stops;
        returns (requests with a new token, finished). Rows of requests preempted, aborted or
        finished since the step was scheduled are dropped."""
        updated, finished = [], []
        for row, item in enumerate(scheduler_output.scheduled):
            request = self._running_ids.get(item.request_id)
            if request is None or request.epoch != item.epoch:
                continue
            if not item.samples:
                self.kv.cache_full_blocks(request)
                continue  # a prefill chunk that has not reached the end of the prompt
            if request.constraints is not None and request.constraints.error:
                # Its mask was not computed: drop the token and end the request.
                request.stop_reason = request.constraints.error
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                updated.append(request)
                finished.append(request)
                continue
            request.append_output_token(step_output.token_ids[row])
            self.num_generated_tokens += 1
            if request.constraints is not None:
                request.constraints.accept(step_output.token_ids[row])
            if step_output.logprobs[row] is not None:
                request.logprobs.append(step_output.logprobs[row])
            self.kv.cache_full_blocks(request)
            updated.append(request)
            status = self._stop_status(request)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return updated, finished

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens < params.min_tokens:
            return self._length_status(request)
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in request.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.constraints is not None and request.constraints.finished:
            return RequestStatus.FINISHED_STOPPED  # the grammar allows nothing more
        return self._length_status(request)

    def _length_status(self, request: Request) -> RequestStatus | None:
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and request.num_output_tokens >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stop(self, request: Request, reason: str) -> None:
        """Ends a request on a stop found outside the scheduler (a stop string); one that
        ended on its length with the same token is relabelled."""
        request.stop_reason = reason
        if request.status.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self._finish(request, RequestStatus.FINISHED_STOPPED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.running.remove(request)
        self._release(request)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.pool.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
        )

    def abort(self, request: Request) -> None:
        """Drops a request at any stage and frees what it held."""
        if request.status.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            self.kv.free(request)
        else:
            self.running.remove(request)
            self._release(request)
        request.status = RequestStatus.FINISHED_ABORTED
