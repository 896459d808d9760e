"""DeepSeek-V4's attention in pure JAX over the flattened batch of a step (the reference of
its kernels): each query attends, in one softmax with a per-head sink logit, to the shared
K=V entries of the last `window` positions of its request (the sliding window, paged like
K/V) and to its request's compressed entries (paged the same way, one entry per `ratio`
tokens): all those whose window has closed (heavily compressed attention), or those of them
the Lightning Indexer picked (compressed sparse attention). A layer without a compressor
passes no entries. The sink takes probability but adds nothing to the output.

T: tokens, R: requests, H: query heads, D: head dim (one shared K=V head), NB / BS: the
window's blocks and tokens per block, MB: its blocks per request, NBc / Bc / MBc: the same
for the compressed entries, k: picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import token_request_index


def layer_of(stack: jax.Array | None, layer: jax.Array | None) -> jax.Array | None:
    """stack[layer] where a layer of a stack is asked for (the C++ kernels read it in place)."""
    return stack if stack is None or layer is None else stack[layer]


def compressed_attention(
    q: jax.Array,  # f32[T, H, D]
    kv: jax.Array,  # f32[NB, BS, D], each position's K=V entry (or [L, ...] with kv_layer)
    block_table: jax.Array,  # i32[R, MB]
    entries: jax.Array | None,  # f32[NBc, Bc, D], compressed K=V entries (None: none; or
    #                             [Lc, ...] with entry_layer)
    entry_table: jax.Array | None,  # i32[R, MBc]
    picks: jax.Array | None,  # i32[T, k], the indexer's (-1: none); None: every closed one
    sinks: jax.Array,  # f32[H], each head's sink logit
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    *,
    window: int,  # a query sees its own position and the window - 1 before it
    ratio: int,  # tokens per compressed entry
    scale: float,
    kv_layer: jax.Array | None = None,  # i32[]: kv's layer of a stack
    entry_layer: jax.Array | None = None,  # i32[]: entries' layer of a stack
) -> jax.Array:  # f32[T, H, D]
    kv, entries = layer_of(kv, kv_layer), layer_of(entries, entry_layer)
    num_tokens = q.shape[0]
    block_size = kv.shape[1]
    request = token_request_index(query_start_loc, num_tokens)
    request = jnp.minimum(request, block_table.shape[0] - 1)  # (padding tokens: any row)
    window = min(window, block_table.shape[1] * block_size)  # (no more than a request holds)
    near = positions[:, None] - jnp.arange(window)  # [T, W], the window's positions
    blocks = block_table[request[:, None], jnp.clip(near, 0) // block_size]
    keys = kv[blocks, jnp.clip(near, 0) % block_size]  # [T, W, D]
    visible = near >= 0
    if entries is not None:
        table = entry_table[request]  # [T, MBc]
        closed_count = ((positions + 1) // ratio)[:, None]  # [T, 1], entries closed
        if picks is None:  # every entry of the request
            far = entries[table].reshape(num_tokens, -1, entries.shape[-1])  # [T, E, D]
            closed = jnp.arange(far.shape[1]) < closed_count  # [T, E]
        else:  # the picked entries only
            per_block = entries.shape[1]
            index = jnp.maximum(picks, 0)  # [T, k]
            blocks = jnp.take_along_axis(table, index // per_block, axis=1)
            far = entries[blocks, index % per_block]  # [T, k, D]
            closed = (picks >= 0) & (picks < closed_count)
        keys = jnp.concatenate([keys, far], axis=1)
        visible = jnp.concatenate([visible, closed], axis=1)
    logits = jnp.einsum("thd,tsd->ths", q, keys) * scale
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None], (num_tokens, sinks.shape[0], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("ths,tsd->thd", probs, keys)
