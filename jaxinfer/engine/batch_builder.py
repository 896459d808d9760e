"""Turns a SchedulerOutput into the bucket-padded, flattened numpy batch of one step."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.batch import BatchInputs, SamplingMetadata
from jaxinfer.engine.block_pool import NULL_BLOCK
from jaxinfer.engine.scheduler import SchedulerOutput
from jaxinfer.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Static choices of the sampler for one step (each combination is compiled once)."""

    all_greedy: bool
    num_logprobs: int  # 0, or MAX_LOGPROBS when any request asks for logprobs


class BatchBuilder:
    def __init__(self, config: EngineConfig):
        self.block_size = config.cache.block_size
        self.max_blocks = config.max_blocks_per_request
        self.scheduler_config = config.scheduler

    def bucket(self, num_tokens: int) -> int:
        buckets = self.scheduler_config.token_buckets
        index = bisect.bisect_left(buckets, num_tokens)
        if index == len(buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
        return buckets[index]

    def padding_batch(self, num_tokens: int) -> tuple[BatchInputs, SamplingMetadata]:
        """An all-padding batch of a token bucket (what build() fills in; also warm-up's input).
        Padding tokens write into the null block; padding requests see nothing."""
        num_reqs = self.scheduler_config.request_bucket(num_tokens)
        batch = BatchInputs(
            token_ids=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.full(num_tokens, NULL_BLOCK * self.block_size, np.int32),
            block_tables=np.full((num_reqs, self.max_blocks), NULL_BLOCK, np.int32),
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
        return batch, sampling

    def build(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[BatchInputs, SamplingMetadata, SamplingFlags]:
        items = scheduler_output.scheduled
        num_reqs = len(items)
        batch, sampling = self.padding_batch(self.bucket(scheduler_output.num_scheduled_tokens))
        bs = self.block_size
        start = 0
        for row, item in enumerate(items):
            request, first, count = item.request, item.num_computed_tokens, item.num_new_tokens
            end = start + count
            batch.token_ids[start:end] = request.all_token_ids[first : first + count]
            positions = np.arange(first, first + count, dtype=np.int32)
            batch.positions[start:end] = positions
            blocks = np.asarray(request.block_ids, np.int32)
            batch.slot_mapping[start:end] = blocks[positions // bs] * bs + positions % bs
            batch.block_tables[row, : len(blocks)] = blocks
            batch.seq_lens[row] = first + count
            batch.query_start_loc[row + 1] = end
            sampling.temperature[row] = request.sampling_params.temperature
            sampling.seeds[row] = (request.seed & 0xFFFFFFFF, (request.seed >> 32) & 0xFFFFFFFF)
            sampling.output_positions[row] = request.num_output_tokens
            start = end
        batch.query_start_loc[num_reqs + 1 :] = start
        batch.logits_indices[:] = np.maximum(batch.query_start_loc[1:] - 1, 0)
        batch.num_seqs[0] = num_reqs
        flags = SamplingFlags(
            all_greedy=all(item.request.sampling_params.greedy for item in items),
            num_logprobs=MAX_LOGPROBS
            if any(item.request.sampling_params.logprobs is not None for item in items)
            else 0,
        )
        return batch, sampling, flags
