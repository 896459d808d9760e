"""Grouped matmul as a Pallas kernel (the routed experts' products on GPU).

Rows of x are sorted by group (expert); group g's rows are offsets[g] .. offsets[g] + sizes[g].
A program computes one [BM, BN] tile of y: its BM rows may span several groups, so it loops
over the groups that intersect the tile (skipping empty ones) and, for each, multiplies the
tile's rows of that group (the others masked to zero) by that group's weight columns, walking
K in steps of BK. Each tile is written once, whole, by one program: no masked or racing
stores. A group's weight is read once per tile of rows it owns, so the cost follows the rows
each expert actually has (not all experts times all rows, as jax.lax.ragged_dot's dense
lowering computes).

M: rows, K: the contracted axis, N: outputs, G: groups; BM x BN: a program's tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.tiles import largest_power_of_two_divisor


def default_block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def _kernel(
    first_ref, last_ref, starts_ref, ends_ref, x_ref, w_ref, y_ref, *, block_m, block_n, block_k
):
    # first_ref, last_ref [tiles]: each row tile's groups; starts_ref, ends_ref [G];
    # x_ref [Mp, K], w_ref [G, K, N], y_ref [Mp, N]
    t, j = pl.program_id(0), pl.program_id(1)
    ds = pl.ds
    rows, cols = ds(t * block_m, block_m), ds(j * block_n, block_n)
    row_ids = t * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    reduce_steps = x_ref.shape[1] // block_k
    # float32 inputs get full-precision dots (a GPU's default for them is TF32)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def group(g, acc):
        start, end = starts_ref[g], ends_ref[g]
        inside = (row_ids >= start) & (row_ids < end)  # [BM, 1]

        def step(k, acc):
            reduce = ds(k * block_k, block_k)
            x = jnp.where(inside, x_ref[rows, reduce], 0).astype(x_ref.dtype)  # [BM, BK]
            w = w_ref[g, reduce, cols].astype(x_ref.dtype)  # [BK, BN] (int8 converted)
            return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

        return jax.lax.cond(
            end > start, lambda a: jax.lax.fori_loop(0, reduce_steps, step, a), lambda a: a, acc
        )

    acc = jnp.zeros((block_m, block_n), jnp.float32)
    acc = jax.lax.fori_loop(first_ref[t], last_ref[t] + 1, group, acc)
    y_ref[rows, cols] = acc.astype(y_ref.dtype)


def grouped_matmul(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [G, K, N] (float, or int8 converted to x's dtype tile by tile)
    group_sizes: jax.Array,  # i32[G], summing to at most M
    *,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # [M, N] in x's dtype; rows after the last group are zero
    """The kernel with the reference's signature (grouped_matmul_reference)."""
    rows, depth = x.shape
    outputs = w.shape[2]
    block_m = block_m or default_block_m(rows)
    block_n = block_n or largest_power_of_two_divisor(outputs, 128)
    block_k = block_k or largest_power_of_two_divisor(depth, 64)
    if block_n < 16 or block_k < 16 or outputs % block_n or depth % block_k:
        raise ValueError(
            f"the grouped matmul kernel tiles K={depth} by {block_k} and N={outputs} by "
            f"{block_n}: both must divide evenly and be at least 16"
        )
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = -(-rows // block_m)
    first_row = jnp.arange(tiles, dtype=jnp.int32) * block_m
    last_row = jnp.minimum(first_row + block_m, ends[-1]) - 1
    first = jnp.searchsorted(ends, first_row, side="right").astype(jnp.int32)
    # a tile past every group's rows loops over no group (and is written as zeros)
    last = jnp.where(
        last_row >= first_row, jnp.searchsorted(ends, last_row, side="right"), first - 1
    ).astype(jnp.int32)
    x = jnp.pad(x, ((0, tiles * block_m - rows), (0, 0)))
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k)
    y = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tiles * block_m, outputs), x.dtype),
        grid=(tiles, outputs // block_n),
        launch=launch,
        interpret=interpret,
        name="grouped_matmul",
    )(first, last, starts, ends, x, w)
    return y[:rows]
