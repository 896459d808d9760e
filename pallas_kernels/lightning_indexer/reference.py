"""DeepSeek-V4's Lightning Indexer in pure JAX: for each query token of a step, the top-k of
its request's compressed entries (compressed sparse attention), scored
sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale, over the flattened batch of a step; the
reference of its kernels.

The indexer's compressed keys live in a paged store like K/V (blocks of entries, a block
table per request; entry e of a request is block table[e // B], offset e % B), written for
the windows a step closes before any query reads them. A query at position p sees the entries
of the windows that closed at or before it: e < (p + 1) // ratio. Picks past those (a query
with fewer than k entries to choose from) are -1.

T: tokens, R: requests, H: indexer heads, Di: their dim, NB / B: blocks of the store and
entries per block, MB: blocks per request, E = MB * B, k: picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.compressed_attention.reference import layer_of
from pallas_kernels.ragged_paged_attention.reference import token_request_index


def indexer_topk(
    q: jax.Array,  # f32[T, H, Di], RoPE'd at the queries' positions
    weights: jax.Array,  # f32[T, H], each head's weight for each query
    keys: jax.Array,  # f32[NB, B, Di], the compressed keys, RoPE'd at their windows' starts
    block_table: jax.Array,  # i32[R, MB]
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    *,
    ratio: int,  # tokens per entry
    topk: int,
    scale: float,  # Di ** -0.5
    layer: jax.Array | None = None,  # i32[]: keys' layer of a stack
) -> jax.Array:  # i32[T, min(k, E)]: entry indices, best first; -1 past the visible ones
    keys = layer_of(keys, layer)
    num_tokens = q.shape[0]
    request = token_request_index(query_start_loc, num_tokens)
    request = jnp.minimum(request, block_table.shape[0] - 1)  # (padding tokens: any row)
    entries = keys[block_table].reshape(block_table.shape[0], -1, keys.shape[-1])  # [R, E, Di]
    per_token = entries[request]  # [T, E, Di]
    scores = jax.nn.relu(jnp.einsum("thd,ted->the", q, per_token)) * scale
    scores = jnp.einsum("the,th->te", scores, weights)  # [T, E]
    visible = jnp.arange(per_token.shape[1]) < ((positions + 1) // ratio)[:, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    best, picks = jax.lax.top_k(scores, min(topk, scores.shape[1]))  # (no more than the store)
    return jnp.where(best > -jnp.inf, picks, -1).astype(jnp.int32)
