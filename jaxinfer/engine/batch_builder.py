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

    def build(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[BatchInputs, SamplingMetadata, SamplingFlags]:
        items = scheduler_output.scheduled
        num_reqs = len(items)
        padded_tokens = self.bucket(scheduler_output.num_scheduled_tokens)
        padded_reqs = self.scheduler_config.request_bucket(padded_tokens)
        bs = self.block_size

        token_ids = np.zeros(padded_tokens, np.int32)
        positions = np.zeros(padded_tokens, np.int32)
        slot_mapping = np.full(padded_tokens, NULL_BLOCK * bs, np.int32)
        block_tables = np.full((padded_reqs, self.max_blocks), NULL_BLOCK, np.int32)
        seq_lens = np.zeros(padded_reqs, np.int32)
        query_start_loc = np.zeros(padded_reqs + 1, np.int32)
        temperature = np.zeros(padded_reqs, np.float32)
        seeds = np.zeros((padded_reqs, 2), np.uint32)
        output_positions = np.zeros(padded_reqs, np.int32)

        start = 0
        for row, item in enumerate(items):
            request, first, count = item.request, item.num_computed_tokens, item.num_new_tokens
            end = start + count
            blocks = request.block_ids
            token_ids[start:end] = request.all_token_ids[first : first + count]
            pos = np.arange(first, first + count, dtype=np.int32)
            positions[start:end] = pos
            block_row = np.asarray(blocks, np.int32)
            slot_mapping[start:end] = block_row[pos // bs] * bs + pos % bs
            block_tables[row, : len(blocks)] = block_row
            seq_lens[row] = first + count
            query_start_loc[row + 1] = end
            params = request.sampling_params
            temperature[row] = params.temperature
            seeds[row] = (request.seed & 0xFFFFFFFF, (request.seed >> 32) & 0xFFFFFFFF)
            output_positions[row] = request.num_output_tokens
            start = end
        query_start_loc[num_reqs + 1 :] = start
        logits_indices = np.maximum(query_start_loc[1:] - 1, 0).astype(np.int32)

        batch = BatchInputs(
            token_ids=token_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            logits_indices=logits_indices,
            num_seqs=np.array([num_reqs], np.int32),
        )
        sampling = SamplingMetadata(
            temperature=temperature, seeds=seeds, output_positions=output_positions
        )
        flags = SamplingFlags(
            all_greedy=all(item.request.sampling_params.greedy for item in items),
            num_logprobs=MAX_LOGPROBS
            if any(item.request.sampling_params.logprobs is not None for item in items)
            else 0,
        )
        return batch, sampling, flags
