"""The step's boundary, as value objects: what the scheduler decides (SchedulerOutput of
ScheduledRequests), what the host sends the device (HostStep), what comes back (StepOutput).

    Scheduler.schedule() -> SchedulerOutput          (ids, counts, token and block ids)
    BatchBuilder.build(SchedulerOutput) -> HostStep   (padded numpy arrays, row updates)
    ModelRunner.execute(HostStep) -> SamplerOutput    (on the device)
    LLMEngine: SamplerOutput -> StepOutput -> Scheduler.update_from_output(...)

Nothing here holds a live Request: downstream of the scheduler a request is its id and the
numbers the step needs. Per-request device rows (the block table, sampler state) are the
runner side's: the batch builder's RowTable gives each running request id a row.

T: tokens in the step (padded to a bucket), R: requests (padded), W: bitmask words, D: tokens
proposed for a request (speculative decoding).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.engine.execution.batch import (
    PenaltyRows,
    RowValues,
    SamplingMetadata,
    SlotCopies,
    StepInputs,
)
from jaxinfer.engine.sampling.sampler import SamplerOutput
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RowInit:
    """What a request's new device row starts with (it was admitted, or resumed after a
    preemption): its token history for the penalties, its fixed logit bias."""

    token_ids: tuple[int, ...] | None  # every known token, when it uses penalties
    num_prompt_tokens: int
    bias: np.ndarray | None  # f32[V], read-only


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    num_computed_tokens: int  # before this step: the first new token's position
    num_new_tokens: int
    # The new tokens known on the host; the step's last token may instead be the output of a
    # step still in flight (async scheduling), read on the device from the request's row.
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # the request's KV blocks after this step's allocation
    samples: bool  # the step reaches the end of the request's tokens, so its sample is kept
    output_position: int  # index in the output of the token sampled (when samples)
    epoch: int  # the request's preemption count when scheduled; a preemption since voids it
    params: SamplingParams
    seed: int
    has_bias: bool
    prompt_token_ids: tuple[int, ...] | list[int]  # the prompt (never changed)
    # i32[1 + D, W]: the tokens allowed at each sampled position (grammars): the request's
    # next token and one more after each proposal.
    bitmask: np.ndarray | None = None
    row_init: RowInit | None = None  # set when the request takes a device row this step
    # Proposed tokens (speculative decoding), the step's last D tokens: the step samples at
    # each of them too, and keeps the samples up to the first that differs from a proposal.
    draft_token_ids: tuple[int, ...] = ()
    pooling: PoolingParams | None = None  # an embedding request's
    lora_slot: int = -1  # the device slot of the request's LoRA adapter (-1: none)
    # A hybrid model's state checkpoints (jaxinfer.engine.scheduling.state_checkpoints): the
    # slot its states start from (a prefix hit) and the slot they are kept in after the step.
    state_restore: int = -1
    state_save: int = -1
    # DeepSeek-V4's compressed entries' blocks after this step's allocation, by store in
    # the order of the block-table row's columns (jaxinfer.layers.compressed_cache)
    entry_block_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_sample_rows(self) -> int:
        """Rows of the sampler this request takes: one, plus one per proposal."""
        return 1 + len(self.draft_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]  # batch order
    num_scheduled_tokens: int
    preempted: tuple[str, ...] = ()  # request ids sent back to the waiting queue this step
    # Request ids whose device rows are free again (finished, aborted or preempted since the
    # last step was scheduled), released before this step's rows are handed out.
    released: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Static choices of the sampler for one step (each is compiled once per request bucket);
    everything else about the parameters is decided on the device."""

    num_logprobs: int  # 0, or MAX_LOGPROBS when any request asks for logprobs


@dataclasses.dataclass(frozen=True)
class RowUpdates:
    """Per-request device rows to rewrite before the step (None: nothing to rewrite)."""

    block_table: RowValues | None = None  # i32[U, MB]
    penalties: PenaltyRows | None = None
    bias: RowValues | None = None  # f32[U, V]
    bitmask: RowValues | None = None  # i32[U, W]
    # A hybrid model's state slots copied: the last step's checkpoints, then prefix hits'
    # restores (jaxinfer.engine.scheduling.state_checkpoints)
    state_saves: SlotCopies | None = None
    state_restores: SlotCopies | None = None


@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """Tokens of the step whose hidden state scores the next prompt token (prompt_logprobs)."""

    rows: np.ndarray  # i32[P], flat token index in the step
    targets: np.ndarray  # i32[P], the prompt token that follows
    spans: tuple[tuple[int, int, int], ...]  # (batch row, first target position, count)


@dataclasses.dataclass(frozen=True)
class PoolingRows:
    """Tokens of the step whose final-norm hidden states embedding requests pool."""

    rows: np.ndarray  # i32[N], flat token index in the step (padded: segment out of range)
    segments: np.ndarray  # i32[N], the batch row each belongs to
    counts: tuple[tuple[int, int], ...]  # (batch row, tokens pooled) per embedding request


@dataclasses.dataclass(frozen=True)
class HostStep:
    """Everything the host sends for one step."""

    inputs: StepInputs
    sampling: SamplingMetadata
    flags: SamplingFlags
    updates: RowUpdates
    prompt_logprobs: PromptLogprobRows | None = None
    pooling: PoolingRows | None = None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Sampled results of one step, on the host, one entry per scheduled request: the token
    sampled at each of its sample rows (one, plus one per proposal) and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float] | None]]


@dataclasses.dataclass(frozen=True)
class DispatchedStep:
    """A step enqueued on the device whose results the engine has not processed yet."""

    scheduler_output: SchedulerOutput
    sampled: SamplerOutput  # on the device
    prompt_rows: PromptLogprobRows | None
    prompt_logprobs: list  # device chunks of (target logprobs, top ids, top logprobs)
    built: float  # perf_counter() when its inputs were built
    dispatched: float  # and when it was enqueued
    pooling_rows: PoolingRows | None = None
    pooled: object = None  # f32[S, E] on the device: the step's sums per batch row


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """perf_counter() marks of one engine.step() call, for tools/profile_step.py. The call
    enqueues one step (when any is scheduled) and returns the results of the oldest step in
    flight: with async scheduling the one enqueued by the call before, else its own."""

    start: float  # scheduling begins
    built: float  # the last step enqueued by the call is built; transfers and dispatch begin
    dispatched: float  # it is enqueued on the device (dispatch is asynchronous)
    ready: float  # the processed step's sampled tokens are on the host
    end: float  # outputs updated, detokenized and returned
    num_tokens: int  # scheduled tokens of the processed step (before padding)
    num_reqs: int
    overlapped: bool  # the processed step was still running when the new one was enqueued


def prefill_chunk(request, num_new: int, new_row: bool = False) -> ScheduledRequest:
    """What the scheduler sends for `request`'s next `num_new` tokens, sampling at their end:
    for harnesses that drive the batch builder and runner without a scheduler (tests, and
    tools.quant_accuracy); `new_row`: the request takes its device row with this step."""
    first = request.num_computed_tokens
    return ScheduledRequest(
        request_id=request.request_id,
        num_computed_tokens=first,
        num_new_tokens=num_new,
        token_ids=tuple(request.all_token_ids[first : first + num_new]),
        block_ids=tuple(request.block_ids),
        samples=True,
        output_position=0,
        epoch=0,
        params=request.sampling_params,
        seed=request.seed,
        has_bias=False,
        prompt_token_ids=request.prompt_token_ids,
        row_init=RowInit(None, request.num_prompt_tokens, None) if new_row else None,
    )
