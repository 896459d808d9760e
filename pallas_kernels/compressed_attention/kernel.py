"""DeepSeek-V4's attention as a Pallas kernel (the reference's signature and results,
pallas_kernels/compressed_attention/reference.py): one program per query token, all its
heads, one online softmax over
- the sliding window: the blocks holding positions (p - window, p] of its request, read
  through its block table;
- the compressed entries: every closed one (HCA: the request's entry blocks up to the last
  closed entry) or the Lightning Indexer's picks (CSA: one entry each, -1 skipped);
- each head's sink logit, which takes probability and adds nothing.

Products are elementwise multiplies and sums (no tensor-core dot: a program's tiles are one
query's heads), so any power-of-two head dim and block size lowers; the heads are padded to
a power of two. Float32 throughout.

T: tokens, H: heads (Hp padded), D: head dim, NB / BS: window blocks and positions per block,
NBc / Bc: entry blocks and entries per block, k: picks.
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
    entry_table_ref,  # i32[R, MBc] (unused without entries)
    picks_ref,  # i32[T, k] (unused without picks)
    q_ref,  # f32[T, Hp, D]
    kv_ref,  # f32[NB, BS, D]
    entries_ref,  # f32[NBc, Bc, D] (unused without entries)
    sinks_ref,  # f32[Hp]
    out_ref,  # f32[T, Hp, D]
    *,
    window: int,
    ratio: int,
    scale: float,
    mode: str,  # "window", "all" (HCA) or "picks" (CSA)
    num_picks: int,
):
    t = pl.program_id(0)
    request, position = request_ref[t], position_ref[t]
    q = q_ref[t]  # [Hp, D]
    heads, dim = q.shape
    block_size = kv_ref.shape[1]

    def update(carry, keys, visible):  # keys [N, D], visible bool[N]
        acc, running_max, denom = carry
        scores = (q[:, None, :] * keys[None, :, :]).sum(axis=2) * scale  # [Hp, N]
        scores = jnp.where(visible[None, :], scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=1))
        correction = jnp.exp(running_max - new_max)
        probs = jnp.where(visible[None, :], jnp.exp(scores - new_max[:, None]), 0.0)
        denom = denom * correction + probs.sum(axis=1)
        acc = acc * correction[:, None] + (probs[:, :, None] * keys[None, :, :]).sum(axis=1)
        return acc, new_max, denom

    def window_block(b, carry):
        keys = kv_ref[table_ref[request, b]]  # [BS, D]
        at = b * block_size + jnp.arange(block_size)
        return update(carry, keys, (at > position - window) & (at <= position))

    carry = (
        jnp.zeros((heads, dim), jnp.float32),
        jnp.full((heads,), MASK_VALUE, jnp.float32),
        jnp.zeros((heads,), jnp.float32),
    )
    first = jnp.maximum(position - window + 1, 0) // block_size
    carry = jax.lax.fori_loop(first, position // block_size + 1, window_block, carry)
    closed = (position + 1) // ratio  # entries whose window has closed
    if mode == "all":
        per_block = entries_ref.shape[1]

        def entry_block(e, carry):
            keys = entries_ref[entry_table_ref[request, e]]  # [Bc, D]
            return update(carry, keys, e * per_block + jnp.arange(per_block) < closed)

        carry = jax.lax.fori_loop(0, (closed + per_block - 1) // per_block, entry_block, carry)
    elif mode == "picks":
        per_block = entries_ref.shape[1]

        def pick(i, carry):
            index = picks_ref[t, i]
            valid = (index >= 0) & (index < closed)
            index = jnp.maximum(index, 0)
            block = entry_table_ref[request, index // per_block]
            key = entries_ref[block, pl.ds(index % per_block, 1)]  # [1, D]
            return update(carry, key, jnp.full((1,), valid))

        carry = jax.lax.fori_loop(0, num_picks, pick, carry)
    acc, running_max, denom = carry
    sinks = sinks_ref[...]  # [Hp]
    new_max = jnp.maximum(running_max, sinks)
    correction = jnp.exp(running_max - new_max)
    denom = denom * correction + jnp.exp(sinks - new_max)
    out_ref[t] = acc * correction[:, None] / denom[:, None]


def compressed_attention(
    q: jax.Array,  # f32[T, H, D]
    kv: jax.Array,  # f32[NB, BS, D] (or [L, ...] with kv_layer)
    block_table: jax.Array,  # i32[R, MB]
    entries: jax.Array | None,  # f32[NBc, Bc, D] (None: none; or [Lc, ...] with entry_layer)
    entry_table: jax.Array | None,  # i32[R, MBc]
    picks: jax.Array | None,  # i32[T, k] (-1: none); None: every closed entry
    sinks: jax.Array,  # f32[H]
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    *,
    window: int,
    ratio: int,
    scale: float,
    kv_layer: jax.Array | None = None,  # i32[]: kv's layer of a stack
    entry_layer: jax.Array | None = None,  # i32[]: entries' layer of a stack
    interpret: bool = False,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # f32[T, H, D]
    kv, entries = layer_of(kv, kv_layer), layer_of(entries, entry_layer)
    num_tokens, heads, dim = q.shape
    check_powers_of_two("compressed-attention", head_dim=dim, block_size=kv.shape[1])
    padded = next_power_of_two(heads)
    request = jnp.minimum(
        token_request_index(query_start_loc, num_tokens), block_table.shape[0] - 1
    )
    mode = "window" if entries is None else ("all" if picks is None else "picks")
    if entries is None:
        entries, entry_table = jnp.zeros((1, 1, dim), jnp.float32), block_table
    if picks is None:
        picks = jnp.zeros((num_tokens, 1), jnp.int32)
    kernel = functools.partial(
        _kernel, window=window, ratio=ratio, scale=scale, mode=mode, num_picks=picks.shape[1]
    )
    out = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, padded, dim), jnp.float32),
        grid=(num_tokens,),
        launch=launch,
        interpret=interpret,
        name="compressed_attention",
    )(
        request.astype(jnp.int32),
        positions.astype(jnp.int32),
        block_table,
        entry_table,
        picks.astype(jnp.int32),
        jnp.pad(q.astype(jnp.float32), ((0, 0), (0, padded - heads), (0, 0))),
        kv.astype(jnp.float32),
        entries.astype(jnp.float32),
        jnp.pad(sinks.astype(jnp.float32), (0, padded - heads), constant_values=MASK_VALUE),
    )
    return out[:, :heads]
