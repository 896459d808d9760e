"""Turns a SchedulerOutput into the bucket-padded, flattened numpy inputs of one step."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.batch import BlockTableUpdate, SamplingMetadata, StepInputs
from jaxinfer.engine.block_pool import NULL_BLOCK
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import SchedulerOutput
from jaxinfer.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Static choices of the sampler for one step (each combination is compiled once)."""

    all_greedy: bool
    num_logprobs: int  # 0, or MAX_LOGPROBS when any request asks for logprobs


@dataclasses.dataclass(frozen=True)
class HostStep:
    """Everything the host sends for one step."""

    inputs: StepInputs
    sampling: SamplingMetadata
    flags: SamplingFlags
    table_update: BlockTableUpdate | None  # None when no request's blocks changed


class BatchBuilder:
    def __init__(self, config: EngineConfig):
        self.block_size = config.cache.block_size
        self.max_blocks = config.max_blocks_per_request
        self.scheduler_config = config.scheduler
        self.padding_slot = config.scheduler.max_num_seqs  # the block table's last row
        self.update_buckets = tuple(
            1 << i for i in range((config.scheduler.max_num_seqs - 1).bit_length() + 1)
        )  # 1, 2, 4, ... up to the first power of two >= max_num_seqs

    def bucket(self, num_tokens: int) -> int:
        buckets = self.scheduler_config.token_buckets
        index = bisect.bisect_left(buckets, num_tokens)
        if index == len(buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
        return buckets[index]

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
        sampling = SamplingMetadata(
            temperature=np.zeros(num_reqs, np.float32),
            seeds=np.zeros((num_reqs, 2), np.uint32),
            output_positions=np.zeros(num_reqs, np.int32),
        )
        return inputs, sampling

    def padding_table_update(self, num_rows: int) -> BlockTableUpdate:
        """num_rows (a bucket) rewrites of the padding row with null blocks."""
        return BlockTableUpdate(
            rows=np.full(num_rows, self.padding_slot, np.int32),
            block_ids=np.full((num_rows, self.max_blocks), NULL_BLOCK, np.int32),
        )

    def build(self, scheduler_output: SchedulerOutput) -> HostStep:
        """Flattens the scheduled requests. A token at or past the request's known tokens is
        the output placeholder of a step in flight: the device reads it from the request's
        slot. Block-table rows go to the device only for requests whose blocks changed."""
        items = scheduler_output.scheduled
        num_reqs = len(items)
        inputs, sampling = self.padding_batch(self.bucket(scheduler_output.num_scheduled_tokens))
        bs = self.block_size
        changed: list[Request] = []
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
                changed.append(request)
            inputs.request_slots[row] = request.batch_slot
            inputs.seq_lens[row] = first + count
            inputs.query_start_loc[row + 1] = end
            sampling.temperature[row] = request.sampling_params.temperature
            sampling.seeds[row] = (request.seed & 0xFFFFFFFF, (request.seed >> 32) & 0xFFFFFFFF)
            sampling.output_positions[row] = item.output_position
            start = end
        inputs.query_start_loc[num_reqs + 1 :] = start
        inputs.logits_indices[:] = np.maximum(inputs.query_start_loc[1:] - 1, 0)
        inputs.num_seqs[0] = num_reqs
        flags = SamplingFlags(
            all_greedy=all(item.request.sampling_params.greedy for item in items),
            num_logprobs=MAX_LOGPROBS
            if any(item.request.sampling_params.logprobs is not None for item in items)
            else 0,
        )
        return HostStep(inputs, sampling, flags, self._table_update(changed))

    def _table_update(self, changed: list[Request]) -> BlockTableUpdate | None:
        if not changed:
            return None
        size = self.update_buckets[bisect.bisect_left(self.update_buckets, len(changed))]
        update = self.padding_table_update(size)
        for index, request in enumerate(changed):
            update.rows[index] = request.batch_slot
            update.block_ids[index, : len(request.block_ids)] = request.block_ids
            request.num_synced_blocks = len(request.block_ids)
        return update
