"""Turns a SchedulerOutput into the bucket-padded, flattened numpy inputs of one step, and the
per-request device rows the device must update first (only those that changed)."""

from __future__ import annotations

import bisect

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.execution.batch import (
    PenaltyRows,
    RowValues,
    SamplingMetadata,
    SlotCopies,
    StepInputs,
)
from jaxinfer.engine.execution.pooling import pooled_span, pooling_rows
from jaxinfer.engine.execution.row_table import RowTable
from jaxinfer.engine.execution.step import (
    HostStep,
    PromptLogprobRows,
    RowUpdates,
    SamplingFlags,
    ScheduledRequest,
    SchedulerOutput,
)
from jaxinfer.engine.sampling.constraints import bitmask_width
from jaxinfer.engine.scheduling.block_pool import NULL_BLOCK
from jaxinfer.layers.compressed_cache import entry_columns
from jaxinfer.sampling_params import MAX_LOGPROBS


def _num_blocks(item: ScheduledRequest) -> int:
    """The blocks of a request's block-table row (KV, and compressed entries')."""
    return len(item.block_ids) + sum(len(blocks) for blocks in item.entry_block_ids)


class BatchBuilder:
    def __init__(self, config: EngineConfig):
        self.block_size = config.cache.block_size
        self.max_blocks = config.block_table_width
        self.max_model_len = config.model.max_model_len
        arch = config.model.arch
        # DeepSeek-V4's: where each compressed store's entry blocks start in a row
        self.entry_starts = () if arch.compressed is None else tuple(
            start for _, start, _ in entry_columns(arch, self.block_size, self.max_model_len)
        )  # fmt: skip
        self.vocab_size = config.model.arch.vocab_size
        self.scheduler_config = config.scheduler
        # The token buckets steps may take: all of them, or (EngineOptions.warmup
        # "background") those compiled so far, the largest always among them.
        self.ready_buckets: tuple[int, ...] = config.scheduler.token_buckets
        self.rows = RowTable(config.scheduler.max_num_seqs)
        self.lora = config.lora is not None  # each token names its adapter slot
        self.padding_row = self.rows.padding_row  # the last row of per-request arrays
        # A hybrid model's state checkpoints (slots after the rows': state_checkpoints), and
        # the copies into them of the last step's, made before the next step runs.
        self.state_checkpoints = config.cache.state_checkpoints
        self._pending_saves: list[tuple[int, int]] = []  # (row, slot)
        # Bitmask rows per request row: one per position a step may sample for it.
        self.mask_rows_per_request = 1 + config.scheduler.num_speculative_tokens
        largest = max(
            config.scheduler.max_num_seqs,
            config.scheduler.sample_bucket(config.scheduler.token_buckets[-1]),
        )
        self.update_buckets = tuple(
            1 << i for i in range((largest - 1).bit_length() + 1)
        )  # 1, 2, 4, ... up to the first power of two >= max_num_seqs (and the sample rows)

    def add_ready_bucket(self, num_tokens: int) -> None:
        """Token bucket `num_tokens` is compiled: steps may take it (from any thread)."""
        self.ready_buckets = tuple(sorted({*self.ready_buckets, num_tokens}))

    def bucket(self, num_tokens: int) -> int:
        """The smallest ready token bucket that holds a step of `num_tokens` tokens."""
        buckets = self.ready_buckets
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
        num_samples = self.scheduler_config.sample_bucket(num_tokens)
        inputs = StepInputs(
            token_ids=np.zeros(num_tokens, np.int32),
            token_rows=np.full(num_tokens, -1, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.full(num_tokens, NULL_BLOCK * self.block_size, np.int32),
            request_rows=np.full(num_reqs, self.padding_row, np.int32),
            seq_lens=np.zeros(num_reqs, np.int32),
            query_start_loc=np.zeros(num_reqs + 1, np.int32),
            logits_indices=np.zeros(num_samples, np.int32),
            num_seqs=np.zeros(1, np.int32),
            num_samples=np.zeros(1, np.int32),
            lora_slots=np.full(num_tokens, -1, np.int32) if self.lora else None,
        )
        sampling = SamplingMetadata.neutral(num_samples, self.padding_row)
        return inputs, sampling

    def subset(self, inputs: StepInputs, keep: list[int]) -> StepInputs:
        """A built step's inputs for the requests at `keep` (their indices in the step,
        ascending) alone, in the smallest ready bucket that holds their tokens: the draft
        model's extend over the requests it follows (no logits: none are sampled). `inputs`
        itself where `keep` is every request."""
        if len(keep) == int(inputs.num_seqs[0]):
            return inputs
        starts = inputs.query_start_loc
        count = sum(int(starts[i + 1] - starts[i]) for i in keep)
        out, _ = self.padding_batch(self.bucket(count))
        per_token = ("token_ids", "token_rows", "positions", "slot_mapping", "lora_slots")
        end = 0
        for index, i in enumerate(keep):
            span, start = slice(starts[i], starts[i + 1]), end
            end = start + int(starts[i + 1] - starts[i])
            for name in per_token:
                if getattr(inputs, name) is not None:
                    getattr(out, name)[start:end] = getattr(inputs, name)[span]
            out.request_rows[index] = inputs.request_rows[i]
            out.seq_lens[index] = inputs.seq_lens[i]
            out.query_start_loc[index + 1] = end
        out.query_start_loc[len(keep) + 1 :] = end
        out.num_seqs[0] = len(keep)
        return out

    def padding_updates(self, num_rows: int) -> RowUpdates:
        """Rewrites of the padding row, num_rows (a bucket) of each kind (for warm-up)."""
        rows = np.full(num_rows, self.padding_row, np.int32)
        return RowUpdates(
            block_table=RowValues(rows, np.full((num_rows, self.max_blocks), NULL_BLOCK, np.int32)),
            penalties=PenaltyRows(
                rows,
                np.zeros((num_rows, self.max_model_len), np.int32),
                np.zeros(num_rows, np.int32),
                np.zeros(num_rows, np.int32),
            ),
            bias=RowValues(rows, np.zeros((num_rows, self.vocab_size), np.float32)),
            bitmask=RowValues(
                rows * self.mask_rows_per_request,
                np.full((num_rows, bitmask_width(self.vocab_size)), -1, np.int32),
            ),
            state_saves=SlotCopies(rows, rows) if self.state_checkpoints else None,
        )

    def build(self, scheduler_output: SchedulerOutput) -> HostStep:
        """Flattens the scheduled requests. A token past the ones known on the host is the
        output of a step in flight: the device reads it from the request's row. Per-request
        rows go to the device only when they change."""
        for request_id in scheduler_output.released:
            self.rows.release(request_id)
        items = scheduler_output.scheduled
        num_reqs = len(items)
        inputs, sampling = self.padding_batch(self.bucket(scheduler_output.num_scheduled_tokens))
        bs = self.block_size
        changed_blocks: list[tuple[int, ScheduledRequest]] = []  # (row, item)
        fresh: list[tuple[int, ScheduledRequest]] = []
        restores: list[tuple[int, int]] = []  # (checkpoint slot, row)
        saves: list[tuple[int, int]] = []  # (row, checkpoint slot)
        constrained: list[tuple[int, ScheduledRequest]] = []
        prompt_spans: list[tuple[int, int, int, int]] = []  # (row, flat start, position, count)
        pool_spans: list[tuple[int, int, int, int]] = []  # (row, flat start, offset, count)
        start = 0
        sample = 0  # the next sample row
        for index, item in enumerate(items):
            first, count = item.num_computed_tokens, item.num_new_tokens
            row = (
                self.rows.assign(item.request_id)
                if item.row_init
                else self.rows.row(item.request_id)
            )
            end = start + count
            known = len(item.token_ids)
            assert count - known <= 1, "only a step's last token can be in flight"
            assert known == count or not item.draft_token_ids, "proposals need the tokens"
            inputs.token_ids[start : start + known] = item.token_ids
            inputs.token_rows[start + known : end] = row
            positions = np.arange(first, first + count, dtype=np.int32)
            inputs.positions[start:end] = positions
            if item.lora_slot >= 0:
                inputs.lora_slots[start:end] = item.lora_slot
            blocks = item.block_ids
            if count == 1:
                inputs.slot_mapping[start] = blocks[first // bs] * bs + first % bs
            else:
                block_array = np.asarray(blocks, np.int32)
                inputs.slot_mapping[start:end] = block_array[positions // bs] * bs + positions % bs
            if self.rows.synced_blocks(item.request_id) != _num_blocks(item):
                changed_blocks.append((row, item))
            if item.row_init is not None:
                fresh.append((row, item))
            if item.state_restore >= 0:
                restores.append((self.padding_row + 1 + item.state_restore, row))
            if item.state_save >= 0:
                saves.append((row, self.padding_row + 1 + item.state_save))
            inputs.request_rows[index] = row
            inputs.seq_lens[index] = first + count
            inputs.query_start_loc[index + 1] = end
            num_rows = item.num_sample_rows
            inputs.logits_indices[sample : sample + num_rows] = np.arange(
                end - num_rows, end, dtype=np.int32
            )
            self._sampling_rows(sampling, sample, row, item)
            if item.pooling is not None:
                pool_spans.append((index, start, *pooled_span(item, first, count)))
            if item.params.prompt_logprobs is not None:
                # Token p's hidden state scores prompt token p + 1.
                last = min(first + count, item.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append((index, start, first + 1, last - first))
            if item.bitmask is not None:
                constrained.append((row, item))
                sampling.constrained[sample : sample + num_rows] = 1
            start = end
            sample += num_rows
        inputs.query_start_loc[num_reqs + 1 :] = start
        inputs.num_seqs[0] = num_reqs
        inputs.num_samples[0] = sample
        flags = SamplingFlags(
            num_logprobs=MAX_LOGPROBS
            if any(item.params.logprobs is not None for item in items)
            else 0,
        )
        updates = RowUpdates(
            block_table=self._block_table_rows(changed_blocks),
            penalties=self._penalty_rows([x for x in fresh if x[1].row_init.token_ids]),
            bias=self._bias_rows([x for x in fresh if x[1].row_init.bias is not None]),
            bitmask=self._bitmask_rows(constrained),
            state_saves=self._slot_copies(self._pending_saves),
            state_restores=self._slot_copies(restores),
        )
        self._pending_saves = saves
        prompt_rows = self._prompt_rows(items, prompt_spans)
        return HostStep(inputs, sampling, flags, updates, prompt_rows, pooling_rows(pool_spans))

    @staticmethod
    def _prompt_rows(
        items: tuple[ScheduledRequest, ...], spans: list[tuple[int, int, int, int]]
    ) -> PromptLogprobRows | None:
        if not spans:
            return None
        rows = np.concatenate([np.arange(s, s + n, dtype=np.int32) for _, s, _, n in spans])
        targets = np.concatenate(
            [np.asarray(items[row].prompt_token_ids[p : p + n], np.int32) for row, _, p, n in spans]
        )
        return PromptLogprobRows(rows, targets, tuple((r, p, n) for r, _, p, n in spans))

    def _sampling_rows(
        self, sampling: SamplingMetadata, first: int, state_row: int, item: ScheduledRequest
    ) -> None:
        """The request's sample rows: first, first + 1, ... (one per output position)."""
        rows = slice(first, first + item.num_sample_rows)
        sampling.fill(
            rows, item.params, self.vocab_size, item.has_bias, item.seed, item.output_position
        )
        sampling.keeps[rows] = item.samples
        sampling.state_rows[rows] = state_row
        sampling.first_rows[rows] = first
        if item.draft_token_ids:
            sampling.drafts[first : first + len(item.draft_token_ids)] = item.draft_token_ids

    def _rows(self, count: int) -> np.ndarray:
        return np.full(self.update_bucket(count), self.padding_row, np.int32)

    def _slot_copies(self, copies: list[tuple[int, int]]) -> SlotCopies | None:
        if not copies:
            return None
        sources, targets = self._rows(len(copies)), self._rows(len(copies))
        sources[: len(copies)], targets[: len(copies)] = zip(*copies, strict=True)
        return SlotCopies(sources, targets)

    def _block_table_rows(self, changed: list[tuple[int, ScheduledRequest]]) -> RowValues | None:
        if not changed:
            return None
        rows = self._rows(len(changed))
        values = np.full((len(rows), self.max_blocks), NULL_BLOCK, np.int32)
        for index, (row, item) in enumerate(changed):
            rows[index] = row
            values[index, : len(item.block_ids)] = item.block_ids
            for start, entry_blocks in zip(self.entry_starts, item.entry_block_ids, strict=True):
                values[index, start : start + len(entry_blocks)] = entry_blocks
            self.rows.set_synced_blocks(item.request_id, _num_blocks(item))
        return RowValues(rows, values)

    def _penalty_rows(self, fresh: list[tuple[int, ScheduledRequest]]) -> PenaltyRows | None:
        if not fresh:
            return None
        rows = self._rows(len(fresh))
        token_ids = np.zeros((len(rows), self.max_model_len), np.int32)
        num_prompt = np.zeros(len(rows), np.int32)
        num_tokens = np.zeros(len(rows), np.int32)
        for index, (row, item) in enumerate(fresh):
            init = item.row_init
            rows[index] = row
            token_ids[index, : len(init.token_ids)] = init.token_ids
            num_prompt[index] = init.num_prompt_tokens
            num_tokens[index] = len(init.token_ids)
        return PenaltyRows(rows, token_ids, num_prompt, num_tokens)

    def _bias_rows(self, fresh: list[tuple[int, ScheduledRequest]]) -> RowValues | None:
        if not fresh:
            return None
        rows = self._rows(len(fresh))
        values = np.zeros((len(rows), self.vocab_size), np.float32)
        for index, (row, item) in enumerate(fresh):
            rows[index] = row
            values[index] = item.row_init.bias
        return RowValues(rows, values)

    def _bitmask_rows(self, constrained: list[tuple[int, ScheduledRequest]]) -> RowValues | None:
        """Each constrained request's rows of the bitmask table (mask_rows_per_request per
        request row, one per sample row)."""
        if not constrained:
            return None
        rows = self._rows(sum(len(item.bitmask) for _, item in constrained))
        rows *= self.mask_rows_per_request
        values = np.full((len(rows), bitmask_width(self.vocab_size)), -1, np.int32)
        index = 0
        for row, item in constrained:
            count = len(item.bitmask)
            rows[index : index + count] = row * self.mask_rows_per_request + np.arange(count)
            values[index : index + count] = item.bitmask
            index += count
        return RowValues(rows, values)
