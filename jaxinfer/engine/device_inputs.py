"""Device-side assembly of a step's BatchInputs from what the host sent and what the device
keeps between steps: the block table (rows by request slot) and the tokens sampled last.

S: block-table rows (slots), MB: blocks per request, T: tokens, R: requests, U: rows updated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.engine.batch import BatchInputs, BlockTableUpdate, StepInputs


def update_block_table(
    block_table: jax.Array,  # i32[S, MB]
    update: BlockTableUpdate,
) -> jax.Array:
    return block_table.at[update.rows].set(update.block_ids)


def assemble_batch(
    inputs: StepInputs,
    block_table: jax.Array,  # i32[S, MB]
    last_tokens: jax.Array,  # i32[S], the token each slot's request sampled last
) -> BatchInputs:
    from_device = inputs.token_slots >= 0  # [T]
    token_ids = jnp.where(
        from_device, last_tokens[jnp.maximum(inputs.token_slots, 0)], inputs.token_ids
    )
    return BatchInputs(
        token_ids=token_ids,
        positions=inputs.positions,
        slot_mapping=inputs.slot_mapping,
        block_tables=block_table[inputs.request_slots],  # [R, MB]
        seq_lens=inputs.seq_lens,
        query_start_loc=inputs.query_start_loc,
        logits_indices=inputs.logits_indices,
        num_seqs=inputs.num_seqs,
    )


def record_sampled(
    last_tokens: jax.Array,  # i32[S]
    request_slots: jax.Array,  # i32[R]
    token_ids: jax.Array,  # i32[R]
) -> jax.Array:
    """Keeps each request's sampled token where the next step's input reads it. Rows that did
    not sample (prefill chunks, padding) write too; nothing reads those values."""
    return last_tokens.at[request_slots].set(token_ids)
