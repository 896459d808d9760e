"""The fixed-shape, flattened batch that one jitted step consumes, and what the host sends to
build it on the device.

T: tokens in the step (padded to a bucket), R: requests (padded), MB: blocks per request,
S: rows of the device-resident block table (max_num_seqs, plus one row for padding requests),
U: block-table rows rewritten in a step (padded to a power of two), P: sample rows (one per
request, plus one per proposed token under speculative decoding; padded).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxinfer.sampling_params import SamplingParams


def seed_words(seed: int) -> tuple[int, int]:
    """A request's 64-bit seed as SamplingMetadata.seeds' low and high 32-bit words."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Sampling parameters of each sample row as arrays (P rows, padded like the batch;
    neutral values in padding rows and for parameters a request does not use). A request
    takes one row, plus one per proposed token it verifies (speculative decoding): its rows
    are consecutive, each for the next output position."""

    temperature: np.ndarray  # f32[P]; 0 means greedy
    top_k: np.ndarray  # i32[P]; 0 means all
    top_p: np.ndarray  # f32[P]; 1 means all
    min_p: np.ndarray  # f32[P]; 0 means off
    repetition_penalty: np.ndarray  # f32[P]; 1 means off
    presence_penalty: np.ndarray  # f32[P]
    frequency_penalty: np.ndarray  # f32[P]
    has_bias: np.ndarray  # i32[P], 1 where the request's bias row applies
    constrained: np.ndarray  # i32[P], 1 where the request's bitmask row applies this step
    seeds: np.ndarray  # u32[P, 2], low and high words of each request's seed
    output_positions: np.ndarray  # i32[P], index of the token being sampled in its output
    keeps: np.ndarray  # i32[P], 1 where the sample is kept (the step ends the request's tokens)
    state_rows: np.ndarray  # i32[P], the request's row of the device's per-request state
    drafts: np.ndarray  # i32[P], the proposal the row's sample is checked against, else -1
    first_rows: np.ndarray  # i32[P], the first sample row of the row's request

    def fill(
        self,
        rows: slice,
        params: SamplingParams,
        vocab_size: int,
        has_bias: bool,
        seed: int,
        first_output_position: int,
    ) -> None:
        """Writes one request's parameters into `rows` (one per output position from
        `first_output_position`): the one filler of sample rows, the model's (BatchBuilder)
        and the draft model's."""
        self.temperature[rows] = params.temperature
        self.top_k[rows] = params.top_k_or_all(vocab_size)
        self.top_p[rows] = params.top_p
        self.min_p[rows] = params.min_p
        self.repetition_penalty[rows] = params.repetition_penalty
        self.presence_penalty[rows] = params.presence_penalty
        self.frequency_penalty[rows] = params.frequency_penalty
        self.has_bias[rows] = has_bias
        self.seeds[rows] = seed_words(seed)
        count = len(range(*rows.indices(len(self.temperature))))
        self.output_positions[rows] = first_output_position + np.arange(count)

    @classmethod
    def neutral(cls, num_reqs: int, padding_row: int = 0) -> SamplingMetadata:
        """Greedy rows with every other parameter off (what padding rows hold)."""
        return cls(
            temperature=np.zeros(num_reqs, np.float32),
            top_k=np.zeros(num_reqs, np.int32),
            top_p=np.ones(num_reqs, np.float32),
            min_p=np.zeros(num_reqs, np.float32),
            repetition_penalty=np.ones(num_reqs, np.float32),
            presence_penalty=np.zeros(num_reqs, np.float32),
            frequency_penalty=np.zeros(num_reqs, np.float32),
            has_bias=np.zeros(num_reqs, np.int32),
            constrained=np.zeros(num_reqs, np.int32),
            seeds=np.zeros((num_reqs, 2), np.uint32),
            output_positions=np.zeros(num_reqs, np.int32),
            keeps=np.zeros(num_reqs, np.int32),
            state_rows=np.full(num_reqs, padding_row, np.int32),
            drafts=np.full(num_reqs, -1, np.int32),
            first_rows=np.arange(num_reqs, dtype=np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The host's part of one step, O(T + R): the device turns it into BatchInputs with the
    block table it keeps (rows addressed by request_rows) and the tokens it sampled last."""

    token_ids: np.ndarray  # i32[T]; 0 where the token is the output of a step still in flight
    token_rows: np.ndarray  # i32[T], the request's row where the token is read on the device,
    #                         else -1
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T]
    request_rows: np.ndarray  # i32[R], each request's block-table row (padding: the last row)
    seq_lens: np.ndarray  # i32[R]
    query_start_loc: np.ndarray  # i32[R + 1]
    logits_indices: np.ndarray  # i32[P]
    num_seqs: np.ndarray  # i32[1]
    lora_slots: np.ndarray | None = None  # i32[T], each token's adapter slot (-1: none)
    num_samples: np.ndarray | None = None  # i32[1], the real rows of logits_indices

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowValues:
    """New contents of some rows of a per-request device array: the block table (rows that gained
    a block or changed hands), the logit bias, the token bitmask. Padding entries rewrite the
    padding row."""

    rows: np.ndarray  # i32[U]
    values: np.ndarray  # [U, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotCopies:
    """A hybrid model's state slots copied into others (checkpoints kept, restored; slots
    past the request rows are checkpoints). Padding entries copy the padding row onto
    itself."""

    sources: np.ndarray  # i32[U]
    targets: np.ndarray  # i32[U]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyRows:
    """Token history of requests that took a row and use penalties: the prompt (for the
    repetition penalty) and the output so far (counts, after a preemption)."""

    rows: np.ndarray  # i32[U]
    token_ids: np.ndarray  # i32[U, max_model_len]
    num_prompt: np.ndarray  # i32[U]
    num_tokens: np.ndarray  # i32[U]
