"""DeepSeek-V4's Lightning Indexer as a Pallas kernel (the reference's signature and picks,
pallas_kernels/lightning_indexer/reference.py): one program per query token scores its
request's entries block by block through the entry block table,
sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale, the entries not yet closed masked; the top-k
of the scores is XLA's (jax.lax.top_k), as in the reference.

Products are elementwise multiplies and sums (a program's tiles are one query's heads), so any
power-of-two head dim and block size lowers; the heads are padded to a power of two (their
weights 0). Float32 throughout.

T: tokens, Hi: indexer heads (padded Hp), Di: their dim, NB / B: entry blocks and entries per
block, MB: blocks per request, k: picks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.compressed_attention.reference import layer_of
from pallas_kernels.ragged_paged_attention.reference import token_request_index
from pallas_kernels.tiles import check_powers_of_two, next_power_of_two

MASK_VALUE = -1e30


def _kernel(
    request_ref,  # i32[T]
    position_ref,  # i32[T]
    table_ref,  # i32[R, MB]
    q_ref,  # f32[T, Hp, Di]
    weights_ref,  # f32[T, Hp]
    keys_ref,  # f32[NB, B, Di]
    scores_ref,  # f32[T, MB * B]
    *,
    ratio: int,
    scale: float,
):
    t = pl.program_id(0)
    request, position = request_ref[t], position_ref[t]
    q, weights = q_ref[t], weights_ref[t]  # [Hp, Di], [Hp]
    per_block = keys_ref.shape[1]
    num_blocks = table_ref.shape[1]
    closed = (position + 1) // ratio  # entries a query at `position` sees

    def score(b, carry):
        keys = keys_ref[table_ref[request, b]]  # [B, Di]
        dots = jnp.maximum((q[:, None, :] * keys[None, :, :]).sum(axis=2), 0.0) * scale
        total = (dots * weights[:, None]).sum(axis=0)  # [B]
        visible = b * per_block + jnp.arange(per_block) < closed
        scores_ref[t, pl.ds(b * per_block, per_block)] = jnp.where(visible, total, MASK_VALUE)
        return carry

    def mask(b, carry):
        scores_ref[t, pl.ds(b * per_block, per_block)] = jnp.full((per_block,), MASK_VALUE)
        return carry

    used = jnp.minimum((closed + per_block - 1) // per_block, num_blocks)
    jax.lax.fori_loop(0, used, score, 0)
    jax.lax.fori_loop(used, num_blocks, mask, 0)


def indexer_topk(
    q: jax.Array,  # f32[T, H, Di]
    weights: jax.Array,  # f32[T, H]
    keys: jax.Array,  # f32[NB, B, Di] (or [L, ...] with layer)
    block_table: jax.Array,  # i32[R, MB]
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    *,
    ratio: int,
    topk: int,
    scale: float,
    layer: jax.Array | None = None,  # i32[]: keys' layer of a stack
    interpret: bool = False,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # i32[T, min(k, E)]: entry indices, best first; -1 past the visible ones
    num_tokens, heads, dim = q.shape
    keys = layer_of(keys, layer)
    per_block = keys.shape[1]
    check_powers_of_two("indexer", head_dim=dim, block_size=per_block)
    padded = next_power_of_two(heads)
    request = jnp.minimum(
        token_request_index(query_start_loc, num_tokens), block_table.shape[0] - 1
    )
    kernel = functools.partial(_kernel, ratio=ratio, scale=scale)
    scores = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, block_table.shape[1] * per_block), jnp.float32),
        grid=(num_tokens,),
        launch=launch,
        interpret=interpret,
        name="lightning_indexer",
    )(
        request.astype(jnp.int32),
        positions.astype(jnp.int32),
        block_table,
        jnp.pad(q.astype(jnp.float32), ((0, 0), (0, padded - heads), (0, 0))),
        jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, padded - heads))),
        keys.astype(jnp.float32),
    )
    best, picks = jax.lax.top_k(scores, min(topk, scores.shape[1]))
    return jnp.where(best > MASK_VALUE, picks, -1).astype(jnp.int32)
