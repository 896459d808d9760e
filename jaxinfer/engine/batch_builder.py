"""Turns a SchedulerOutput into the bucket-padded, flattened numpy inputs of one step, and the
per-slot rows the device must update first (only those that changed)."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.batch import PenaltyRows, SamplingMetadata, SlotRows, StepInputs
from jaxinfer.engine.block_pool import NULL_BLOCK
from jaxinfer.engine.constraints import bitmask_width
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from jaxinfer.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Static choices of the sampler for one step (each is compiled once per request bucket);
    everything else about the parameters is decided on the device."""

    num_logprobs: int  # 0, or MAX_LOGPROBS when any request asks for logprobs


@dataclasses.dataclass(frozen=True)
class SlotUpdates:
    """Per-slot device rows to rewrite before the step (None: nothing to rewrite)."""

    block_table: SlotRows | None = None  # i32[U, MB]
    penalties: PenaltyRows | None = None
    bias: SlotRows | None = None  # f32[U, V]
    bitmask: SlotRows | None = None  # i32[U, W]


@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """Tokens of the step whose hidden state scores the next prompt token (prompt_logprobs)."""

    rows: np.ndarray  # i32[P], flat token index in the step
    targets: np.ndarray  # i32[P], the prompt token that follows
    spans: tuple[tuple[int, int, int], ...]  # (batch row, first target position, count)


@dataclasses.dataclass(frozen=True)
class HostStep:
    """Everything the host sends for one step."""

    inputs: StepInputs
    sampling: SamplingMetadata
    flags: SamplingFlags
    updates: SlotUpdates
    prompt_logprobs: PromptLogprobRows | None = None


class BatchBuilder:
    def __init__(self, config: EngineConfig):
        self.block_size = config.cache.block_size
        self.max_blocks = config.max_blocks_per_request
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.arch.vocab_size
        self.scheduler_config = config.scheduler
        self.padding_slot = config.scheduler.max_num_seqs  # the last row of per-slot arrays
        self.update_buckets = tuple(
            1 << i for i in range((config.scheduler.max_num_seqs - 1).bit_length() + 1)
        )  # 1, 2, 4, ... up to the first power of two >= max_num_seqs

    def bucket(self, num_tokens: int) -> int:
        buckets = self.scheduler_config.token_buckets
        index = bisect.bisect_left(buckets, num_tokens)
        if index == len(buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
        return buckets[index]

    def update_bucket(self, num_rows: int) -> int:
        return self.update_buckets[bisect.bisect_left(self.update_buckets, num_rows)]

    def padding_batch(self, num_tokens: int) -> tuple[StepInputs, SamplingMetadata]:
        """An all-padding step of a token bucket (what build() fills in; also warm-up's input).
        Padding tokens write into the null block; padding requests see nothing."""
        num_reqs = self.scheduler_config.request_bucket(num_tokens)
        inputs = StepInputs(
            token_ids=np.zeros(num_tokens, np.int32),
            token_slots=np.full(num_tokens, -1, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.full(num_tokens, NULL_BLOCK * self.block_size, np.int32),
            request_slots=np.full(num_reqs, self.padding_slot, np.int32),
            seq_lens=np.zeros(num_reqs, np.int32),
            query_start_loc=np.zeros(num_reqs + 1, np.int32),
            logits_indices=np.zeros(num_reqs, np.int32),
            num_seqs=np.zeros(1, np.int32),
        )
        sampling = SamplingMetadata.neutral(num_reqs)
        return inputs, sampling

    def padding_updates(self, num_rows: int) -> SlotUpdates:
        """Rewrites of the padding slot, num_rows (a bucket) of each kind (for warm-up)."""
        rows = np.full(num_rows, self.padding_slot, np.int32)
        return SlotUpdates(
            block_table=SlotRows(rows, np.full((num_rows, self.max_blocks), NULL_BLOCK, np.int32)),
            penalties=PenaltyRows(
                rows,
                np.zeros((num_rows, self.max_model_len), np.int32),
                np.zeros(num_rows, np.int32),
                np.zeros(num_rows, np.int32),
            ),
            bias=SlotRows(rows, np.zeros((num_rows, self.vocab_size), np.float32)),
            bitmask=SlotRows(
                rows, np.full((num_rows, bitmask_width(self.vocab_size)), -1, np.int32)
            ),
        )

    def build(self, scheduler_output: SchedulerOutput) -> HostStep:
        """Flattens the scheduled requests. A token at or past the request's known tokens is
        the output placeholder of a step in flight: the device reads it from the request's
        slot. Per-slot rows go to the device only when they change."""
        items = scheduler_output.scheduled
        num_reqs = len(items)
        inputs, sampling = self.padding_batch(self.bucket(scheduler_output.num_scheduled_tokens))
        bs = self.block_size
        changed_blocks: list[Request] = []
        fresh: list[Request] = []
        constrained: list[ScheduledRequest] = []
        prompt_spans: list[tuple[int, int, int, int]] = []  # (row, flat start, position, count)
        start = 0
        for row, item in enumerate(items):
            request, first, count = item.request, item.num_computed_tokens, item.num_new_tokens
            end = start + count
            known = min(request.num_tokens - first, count)
            assert count - known <= 1, "only a step's last token can be in flight"
            inputs.token_ids[start : start + known] = request.all_token_ids[first : first + known]
            inputs.token_slots[start + known : end] = request.batch_slot
            positions = np.arange(first, first + count, dtype=np.int32)
            inputs.positions[start:end] = positions
            blocks = request.block_ids
            if count == 1:
                inputs.slot_mapping[start] = blocks[first // bs] * bs + first % bs
            else:
                block_array = np.asarray(blocks, np.int32)
                inputs.slot_mapping[start:end] = block_array[positions // bs] * bs + positions % bs
            if request.num_synced_blocks != len(blocks):
                changed_blocks.append(request)
            if request.needs_slot_init:
                fresh.append(request)
            inputs.request_slots[row] = request.batch_slot
            inputs.seq_lens[row] = first + count
            inputs.query_start_loc[row + 1] = end
            self._sampling_row(sampling, row, item)
            if request.sampling_params.prompt_logprobs is not None:
                # Token p's hidden state scores prompt token p + 1.
                last = min(first + count, request.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append((row, start, first + 1, last - first))
            constraints = request.constraints
            if item.samples and constraints and constraints.active(item.output_position):
                constrained.append(item)
                sampling.constrained[row] = 1
            start = end
        inputs.query_start_loc[num_reqs + 1 :] = start
        inputs.logits_indices[:] = np.maximum(inputs.query_start_loc[1:] - 1, 0)
        inputs.num_seqs[0] = num_reqs
        flags = SamplingFlags(
            num_logprobs=MAX_LOGPROBS
            if any(item.request.sampling_params.logprobs is not None for item in items)
            else 0,
        )
        updates = SlotUpdates(
            block_table=self._block_table_rows(changed_blocks),
            penalties=self._penalty_rows([r for r in fresh if r.sampling_params.uses_penalties]),
            bias=self._bias_rows([r for r in fresh if r.bias is not None]),
            bitmask=self._bitmask_rows(constrained),
        )
        for request in fresh:
            request.needs_slot_init = False
        return HostStep(inputs, sampling, flags, updates, self._prompt_rows(items, prompt_spans))

    @staticmethod
    def _prompt_rows(
        items: tuple[ScheduledRequest, ...], spans: list[tuple[int, int, int, int]]
    ) -> PromptLogprobRows | None:
        if not spans:
            return None
        rows = np.concatenate([np.arange(s, s + n, dtype=np.int32) for _, s, _, n in spans])
        targets = np.concatenate(
            [
                np.asarray(items[row].request.prompt_token_ids[p : p + n], np.int32)
                for row, _, p, n in spans
            ]
        )
        return PromptLogprobRows(rows, targets, tuple((r, p, n) for r, _, p, n in spans))

    def _sampling_row(self, sampling: SamplingMetadata, row: int, item: ScheduledRequest) -> None:
        request = item.request
        params = request.sampling_params
        sampling.temperature[row] = params.temperature
        sampling.top_k[row] = params.top_k_or_all(self.vocab_size)
        sampling.top_p[row] = params.top_p
        sampling.min_p[row] = params.min_p
        sampling.repetition_penalty[row] = params.repetition_penalty
        sampling.presence_penalty[row] = params.presence_penalty
        sampling.frequency_penalty[row] = params.frequency_penalty
        sampling.has_bias[row] = request.bias is not None
        sampling.seeds[row] = (request.seed & 0xFFFFFFFF, (request.seed >> 32) & 0xFFFFFFFF)
        sampling.output_positions[row] = item.output_position
        sampling.keeps[row] = item.samples

    def _rows(self, count: int) -> np.ndarray:
        return np.full(self.update_bucket(count), self.padding_slot, np.int32)

    def _block_table_rows(self, changed: list[Request]) -> SlotRows | None:
        if not changed:
            return None
        rows = self._rows(len(changed))
        values = np.full((len(rows), self.max_blocks), NULL_BLOCK, np.int32)
        for index, request in enumerate(changed):
            rows[index] = request.batch_slot
            values[index, : len(request.block_ids)] = request.block_ids
            request.num_synced_blocks = len(request.block_ids)
        return SlotRows(rows, values)

    def _penalty_rows(self, requests: list[Request]) -> PenaltyRows | None:
        if not requests:
            return None
        rows = self._rows(len(requests))
        token_ids = np.zeros((len(rows), self.max_model_len), np.int32)
        num_prompt = np.zeros(len(rows), np.int32)
        num_tokens = np.zeros(len(rows), np.int32)
        for index, request in enumerate(requests):
            rows[index] = request.batch_slot
            token_ids[index, : request.num_tokens] = request.all_token_ids
            num_prompt[index] = request.num_prompt_tokens
            num_tokens[index] = request.num_tokens
        return PenaltyRows(rows, token_ids, num_prompt, num_tokens)

    def _bias_rows(self, requests: list[Request]) -> SlotRows | None:
        if not requests:
            return None
        rows = self._rows(len(requests))
        values = np.zeros((len(rows), self.vocab_size), np.float32)
        for index, request in enumerate(requests):
            rows[index] = request.batch_slot
            values[index] = request.bias
        return SlotRows(rows, values)

    def _bitmask_rows(self, items: list[ScheduledRequest]) -> SlotRows | None:
        if not items:
            return None
        rows = self._rows(len(items))
        values = np.full((len(rows), bitmask_width(self.vocab_size)), -1, np.int32)
        for index, item in enumerate(items):
            request = item.request
            constraints = request.constraints
            if constraints.depends_on_tokens:
                assert request.num_output_placeholders == 1, "a sampled token is still in flight"
            rows[index] = request.batch_slot
            constraints.fill(values, index, request.output_token_ids, item.output_position)
        return SlotRows(rows, values)
