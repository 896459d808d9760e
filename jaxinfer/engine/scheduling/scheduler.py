"""Continuous batching at token level.

No prefill or decode phase: each step gives every request num_tokens - num_computed_tokens new
tokens, within max_num_seqs, the token budget, max_model_len and the free KV blocks. Running
requests go first, in arrival order, so a long prompt (chunked by the budget) never stalls them;
when the pool runs dry the latest-arrived running request is preempted and recomputed later.
A hybrid model's prompt steps are cut at block boundaries where its states are checkpointed
for prefix hits (KVCacheManager.align_chunk).

A step is applied to the requests when it is scheduled: num_computed_tokens advances and each
request that samples gains an output placeholder. update_from_output later fills the
placeholders with the sampled tokens and applies stops. So the engine may schedule step N+1
while step N runs on the device (async scheduling): a decode's input token is then step N's
placeholder, read on the device; the results of steps that a preemption or abort overtook are
dropped.

Speculative decoding: a running request caught up to its last token whose proposals are set
(request.spec_token_ids) schedules them too, 1 + D tokens; proposals are dropped, never the
request, when the budget or the pool is short. The step samples after each; update_from_output
keeps the samples up to the first that differs from its proposal and moves
num_computed_tokens back over the rejected ones (their KV slots are written again later, their
blocks kept for the tokens to come). Only tokens known on the host are ever hashed into the
prefix cache, so a rejected proposal never is. Steps with proposals need the tokens on the host
(the engine processes the step in flight first).
"""

from __future__ import annotations

import bisect

from jaxinfer.config import SchedulerConfig
from jaxinfer.engine.execution.step import RowInit, ScheduledRequest, SchedulerOutput, StepOutput
from jaxinfer.engine.sampling.constraints import step_bitmask
from jaxinfer.engine.scheduling.admission import check_admissible
from jaxinfer.engine.scheduling.kv_cache_manager import KVCacheManager
from jaxinfer.engine.scheduling.lora_slots import LoraSlots
from jaxinfer.engine.scheduling.request import Request, RequestStatus
from jaxinfer.engine.scheduling.stats import SchedulerStats, SpecStats
from jaxinfer.engine.scheduling.stopping import sampled_enough, stop_status
from jaxinfer.engine.speculation.control import SpecControl, plan_proposals, record_verdict
from jaxinfer.sampling_params import SamplingParams


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        vocab_size: int = 0,
        control: SpecControl | None = None,
        loras: LoraSlots | None = None,
    ):
        """`vocab_size`: the width of grammar bitmask rows (requests with constraints).
        `control`: plans each step's proposals by measured step times (speculative decoding;
        None: the rule of thumb, proposals only where a step has room for free). `loras`: the
        LoRA adapters' device slots (a request is admitted with its adapter in one)."""
        self.config = config
        self.loras = loras
        self.control = control
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
        self.spec_stats = SpecStats() if config.num_speculative_tokens else None

    def check_admissible(self, prompt_len: int, params: SamplingParams) -> None:
        """Raises ValueError for a request that could never complete, or asks for what the
        engine cannot do (it reads only the configuration, so any thread may call it)."""
        check_admissible(self.config, self.kv, prompt_len, params)

    def add_request(self, request: Request) -> None:
        self.check_admissible(request.num_prompt_tokens, request.sampling_params)
        request.arrival_index = self._arrivals
        self._arrivals += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []  # (request, new tokens)
        preempted: list[str] = []
        self.kv.step_scheduled()

        admitted: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            computed = request.num_computed_tokens
            num_new = min(request.num_tokens_with_placeholders - computed, budget)
            num_new = self.kv.align_chunk(request, computed, num_new)
            if num_new <= 0 or sampled_enough(request, self.config.max_model_len):
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

        position = 0  # in the waiting queue: requests whose adapter has no slot are passed over
        while (
            not preempted
            and position < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[position]
            if self.kv.awaits_checkpoint(request) or (self.loras and not self.loras.take(request)):
                position += 1
                continue
            hits = self.kv.get_computed_blocks(request)
            start = request.num_computed_tokens + len(hits) * self.kv.block_size
            num_new = self.kv.align_chunk(request, start, min(request.num_tokens - start, budget))
            if not self.kv.allocate_blocks(request, num_new, hits):
                if self.loras:
                    self.loras.drop(request)
                break
            if self.kv.enable_prefix_caching:
                self.kv.record_prefix_lookup(request.num_tokens, start)
                # Admitted now, never preempted in this step: its prompt blocks can be shared
                # at once (the n samples of one prompt, prompts arriving together).
                self.kv.cache_full_blocks(request, request.num_computed_tokens + num_new)
            self.waiting.pop(position)
            request.status = RequestStatus.RUNNING
            request.epoch = self._admissions
            self._admissions += 1
            self.running.append(request)
            self._running_ids[request.request_id] = request
            admitted.add(request.request_id)
            scheduled.append((request, num_new))
            budget -= num_new

        if self.config.num_speculative_tokens and scheduled:
            budget = self._add_proposals(scheduled, budget)
        if self.config.spec_lookahead:
            self._allocate_lookahead(scheduled)

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

    def _add_proposals(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        """Adds the proposals of scheduled requests caught up to their last token, as many as
        pay for their time (plan_proposals), within the budget and the pool (no preemption
        for a proposal); at most spec_free_tokens proposals in all, so a step's sample rows
        stay within SchedulerConfig.sample_bucket. Returns the budget left."""
        entries = [
            (index, request)
            for index, (request, num_new) in enumerate(scheduled)
            if request.spec_token_ids
            and num_new == 1
            and request.num_tokens - request.num_computed_tokens == 1
            and not request.num_output_placeholders
        ]
        if not entries:
            return budget
        used = self.config.max_num_batched_tokens - budget
        num_sampling = sum(
            r.num_computed_tokens + n >= r.num_tokens_with_placeholders for r, n in scheduled
        )
        counts = self.plan_proposals(
            used, num_sampling, [(r, len(r.spec_token_ids)) for _, r in entries]
        )
        for (index, request), count in zip(entries, counts, strict=True):
            if not count:
                request.spec.declined()
            elif self.kv.allocate_blocks(request, 1 + count):
                scheduled[index] = (request, 1 + count)
                budget -= count
        return budget

    def plan_proposals(
        self, used: int, num_sampling: int, wanted: list[tuple[Request, int]], **proposer: int
    ) -> list[int]:
        """Proposals to take of each (request, most it could verify) in a step of `used`
        tokens of which `num_sampling` requests sample; `proposer`: the proposer's rows still
        to pay for (draft_rows, host_rows; jaxinfer.engine.speculation.control)."""
        candidates = [(r.spec, count) for r, count in wanted]
        return plan_proposals(self.config, self.control, used, num_sampling, candidates, **proposer)

    def proposal_room(self) -> tuple[int, int]:
        """(tokens, sampling requests) of the next step if it scheduled the running
        requests' own tokens and nothing else: what a proposer that pays for each proposal
        (a draft model) plans for (plan_proposals)."""
        running = [r for r in self.running if not sampled_enough(r, self.config.max_model_len)]
        used = sum(r.num_tokens_with_placeholders - r.num_computed_tokens for r in running)
        return min(used, self.config.max_num_batched_tokens), len(running)

    def _allocate_lookahead(self, scheduled: list[tuple[Request, int]]) -> None:
        """Gives each proposing request that samples in the step blocks for spec_lookahead
        tokens past it, where the pool has them free (never by preemption): a draft model
        writes the K/V of its next proposals there before the step that verifies them
        (jaxinfer.engine.speculation.draft_model). A request without them proposes fewer tokens."""
        for request, num_new in scheduled:
            end = request.num_computed_tokens + num_new
            spec = request.spec
            if spec is None or spec.draft_off or end < request.num_tokens_with_placeholders:
                continue
            extra = min(self.config.spec_lookahead, self.config.max_model_len - end)
            if extra > 0:
                self.kv.allocate_blocks(request, num_new + extra)

    def _apply(self, request: Request, num_new: int, admitted: bool) -> ScheduledRequest:
        """Advances the request by a scheduled step (before the step runs) and describes the
        step's part for it."""
        first = request.num_computed_tokens
        num_drafts = max(first + num_new - request.num_tokens_with_placeholders, 0)
        drafts = tuple(request.spec_token_ids[:num_drafts])
        request.spec_token_ids = []
        samples = first + num_new >= request.num_tokens_with_placeholders
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
            token_ids=tuple(request.all_token_ids[first : first + num_new - num_drafts]) + drafts,
            block_ids=tuple(request.block_ids),
            entry_block_ids=tuple(tuple(b) for b in request.entry_block_ids.values()),
            samples=samples,
            output_position=output_position,
            epoch=request.epoch,
            params=params,
            seed=request.seed,
            has_bias=request.bias is not None,
            prompt_token_ids=request.prompt_token_ids,
            bitmask=step_bitmask(request, output_position, drafts, self.vocab_size)
            if samples
            else None,
            row_init=row_init,
            draft_token_ids=drafts,
            pooling=request.pooling,
            lora_slot=request.lora_slot,
            state_restore=request.state_restore if admitted else -1,
            state_save=self.kv.checkpoint_slot(request, first, first + num_new),
        )
        request.num_computed_tokens = first + num_new
        if samples:
            request.num_output_placeholders += 1
        return item

    def _verify(self, request: Request, item: ScheduledRequest, sampled: list[int]) -> list[int]:
        """The tokens a step gives a request: its samples up to and including the first that
        differs from the proposal at its position (all of them when every proposal matched);
        num_computed_tokens moves back over the rejected proposals."""
        drafts = item.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        if drafts:
            request.num_computed_tokens -= len(drafts) - accepted
            self.spec_stats.record(len(drafts), accepted)
            if request.spec is not None:
                record_verdict(self.control, request.spec, len(drafts), accepted)
        return sampled[: accepted + 1]

    def _release(self, request: Request) -> None:
        """Gives back everything a request holds that leaves the running set (its device row
        goes with the next step's SchedulerOutput.released)."""
        if self.loras:
            self.loras.drop(request)
        self.kv.free(request)
        del self._running_ids[request.request_id]
        self._released.append(request.request_id)
        request.num_output_placeholders = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        if request.spec is not None:
            request.spec.draft_computed = 0
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
            tokens = self._verify(request, item, step_output.token_ids[row])
            status = None
            for position, token in enumerate(tokens):
                if position == 0:
                    request.append_output_token(token)
                else:
                    request.append_accepted_token(token)
                self.num_generated_tokens += 1
                if request.constraints is not None:
                    request.constraints.accept(token)
                if step_output.logprobs[row][position] is not None:
                    request.logprobs.append(step_output.logprobs[row][position])
                status = stop_status(request, self.config.max_model_len)
                if status is not None:
                    break  # the tokens after a stop are dropped
            self.kv.cache_full_blocks(request)
            updated.append(request)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return updated, finished

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
        usage = self.kv.usage()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=usage["kv_blocks"],
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            spec=self.spec_stats.snapshot() if self.spec_stats is not None else None,
            cache_usage=usage,
            cache_capacity=self.kv.capacity(),
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
