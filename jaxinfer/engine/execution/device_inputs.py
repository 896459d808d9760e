"""Device-side assembly of a step's BatchInputs from what the host sent and what the device
keeps between steps (the block table, each row's last sampled token, the sampler's per-request
state), and the updates of the rows that changed.

S: per-request rows, MB: blocks per request, T: tokens, R: requests, U: rows updated, V: vocabulary,
L: max_model_len.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.engine.execution.batch import (
    PenaltyRows,
    RowValues,
    SamplingMetadata,
    StepInputs,
)
from jaxinfer.engine.sampling.sampler import DraftProbs, SamplerState
from jaxinfer.models.inputs import BatchInputs


def set_rows(table: jax.Array, update: RowValues) -> jax.Array:  # [S, ...]
    return table.at[update.rows].set(update.values)


def set_bias_rows(state: SamplerState, update: RowValues) -> SamplerState:
    return dataclasses.replace(state, bias=set_rows(state.bias, update))


def set_bitmask_rows(state: SamplerState, update: RowValues) -> SamplerState:
    return dataclasses.replace(state, bitmask=set_rows(state.bitmask, update))


def set_penalty_rows(state: SamplerState, update: PenaltyRows) -> SamplerState:
    """Rebuilds the prompt mask and output counts of requests that took a row."""
    num_rows, length = update.token_ids.shape
    vocab = state.output_counts.shape[1]
    position = jnp.arange(length)[None, :]  # [1, L]
    in_prompt = position < update.num_prompt[:, None]  # [U, L]
    in_output = ~in_prompt & (position < update.num_tokens[:, None])
    row = jnp.broadcast_to(jnp.arange(num_rows)[:, None], (num_rows, length))
    prompt_mask = jnp.zeros((num_rows, vocab), bool).at[row, update.token_ids].max(in_prompt)
    counts = (
        jnp.zeros((num_rows, vocab), jnp.int32)
        .at[row, update.token_ids]
        .add(in_output.astype(jnp.int32))
    )
    return dataclasses.replace(
        state,
        prompt_mask=state.prompt_mask.at[update.rows].set(prompt_mask),
        output_counts=state.output_counts.at[update.rows].set(counts),
    )


def assemble_batch(
    inputs: StepInputs,
    block_table: jax.Array,  # i32[S, MB]
    last_tokens: jax.Array,  # i32[S], the token each row's request sampled last
) -> BatchInputs:
    from_device = inputs.token_rows >= 0  # [T]
    token_ids = jnp.where(
        from_device, last_tokens[jnp.maximum(inputs.token_rows, 0)], inputs.token_ids
    )
    return BatchInputs(
        token_ids=token_ids,
        positions=inputs.positions,
        slot_mapping=inputs.slot_mapping,
        block_tables=block_table[inputs.request_rows],  # [R, MB]
        seq_lens=inputs.seq_lens,
        query_start_loc=inputs.query_start_loc,
        logits_indices=inputs.logits_indices,
        num_seqs=inputs.num_seqs,
        lora_slots=inputs.lora_slots,
        state_rows=inputs.request_rows,
        num_samples=inputs.num_samples,
    )


def accepted_rows(
    token_ids: jax.Array,  # i32[P], sampled
    sampling: SamplingMetadata,
) -> jax.Array:  # bool[P]
    """Sample rows whose token is kept: the request's sample is kept (sampling.keeps) and no
    earlier row of the same request sampled something other than its proposal (the host's
    verification, jaxinfer.engine.scheduling.scheduler, keeps the same rows)."""
    mismatch = ((sampling.drafts >= 0) & (token_ids != sampling.drafts)).astype(jnp.int32)
    before = jnp.cumsum(mismatch) - mismatch  # mismatches in rows before each row
    return (sampling.keeps > 0) & (before == before[sampling.first_rows])


def record_sampled(
    last_tokens: jax.Array,  # i32[S]
    state: SamplerState,
    token_ids: jax.Array,  # i32[P]
    sampling: SamplingMetadata,
) -> tuple[jax.Array, SamplerState]:
    """Counts each kept sample in the output counts of the penalties, and keeps each request's
    last kept token where the next step's input reads it."""
    rows = sampling.state_rows
    kept = accepted_rows(token_ids, sampling)
    counts = state.output_counts.at[rows, token_ids].add(kept.astype(jnp.int32))
    following = jnp.roll(kept, -1) & (jnp.roll(sampling.first_rows, -1) == sampling.first_rows)
    following = following.at[-1].set(False)
    last = kept & ~following
    targets = jnp.where(last, rows, last_tokens.shape[0])  # out of range: dropped
    return (
        last_tokens.at[targets].set(token_ids, mode="drop"),
        dataclasses.replace(state, output_counts=counts),
    )


def verified_probs(
    draft_probs: jax.Array,  # f32[S * K, V]
    sampling: SamplingMetadata,  # the target step's sample rows [P]
    num_speculative: int,
) -> DraftProbs:
    """q of the proposal each sample row verifies (rows without one: any row's), gathered
    where the sampler reads it."""
    index = jnp.arange(sampling.first_rows.shape[0]) - sampling.first_rows
    index = jnp.clip(index, 0, num_speculative - 1)
    return DraftProbs(draft_probs, sampling.state_rows * num_speculative + index)
