"""y = x @ w as a Pallas kernel whose tiles are the same for every number of rows, so each
output is reduced in one order whatever else is in the batch (the batch-invariant mode).

T: rows of x, K: the contracted axis, N: output columns, BT x BN: a program's output tile, BK:
the reduction step, L: layers of a stacked weight. w is [K, N] ("in_out") or [N, K] ("out_in",
the engine's layout under batch_invariant), either of them possibly one layer of [L, ...] read in
place.

A program computes one [BT, BN] tile: it walks K in steps of BK, in order, adding each step's
tile product to a float32 accumulator (no split-K). BT, BN and BK depend only on K and N,
never on T: XLA's dot (cuBLAS on a GPU) picks its tiling and split-K from the whole shape, T
included, which is what changes a row's last bits with the batch. Rows are padded to a
multiple of BT.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.tiles import largest_power_of_two_divisor

BLOCK_T = 16  # rows per program: Triton's smallest dot, for every batch
IN_OUT, OUT_IN = "in_out", "out_in"


def _matmul_kernel(layer_ref, x_ref, w_ref, y_ref, *, block_t, block_n, block_k, layout):
    # layer_ref i32[1]; x_ref [Tp, K]; w_ref [L, K, N] (in_out) or [L, N, K] (out_in);
    # y_ref [Tp, N]
    t, n = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(t * block_t, block_t), pl.ds(n * block_n, block_n)
    layer = layer_ref[0]
    # float32 inputs get full-precision dots (a GPU's default for them is TF32)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(k, acc):
        reduce = pl.ds(k * block_k, block_k)
        x = x_ref[rows, reduce]  # [BT, BK]
        if layout == IN_OUT:
            w = w_ref[layer, reduce, cols]  # [BK, BN]
            dims = (((1,), (0,)), ((), ()))
        else:
            w = w_ref[layer, cols, reduce]  # [BN, BK]
            dims = (((1,), (1,)), ((), ()))
        return acc + jax.lax.dot_general(
            x, w, dims, precision=precision, preferred_element_type=jnp.float32
        )

    acc = jax.lax.fori_loop(
        0, x_ref.shape[1] // block_k, body, jnp.zeros((block_t, block_n), jnp.float32)
    )
    y_ref[rows, cols] = acc.astype(y_ref.dtype)


def matmul(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [K, N] (in_out) or [N, K] (out_in); with `layer`: [L, ...] stacked
    *,
    layout: str = IN_OUT,
    layer: jax.Array | None = None,  # i32[]: the layer of a stacked w, read in place
    interpret: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # [T, N]
    """The Pallas kernel with the reference's signature (see the module docstring); w in
    either layout, or one layer of a stack of them read in place (no slice copied)."""
    if layout not in (IN_OUT, OUT_IN):
        raise ValueError(f"layout must be {IN_OUT!r} or {OUT_IN!r}, got {layout!r}")
    if layer is None:
        w, layer = w[None], 0
    num_rows, depth = x.shape
    columns = w.shape[2] if layout == IN_OUT else w.shape[1]
    block_n = block_n or largest_power_of_two_divisor(columns, 64)
    block_k = block_k or largest_power_of_two_divisor(depth, 64)
    if block_n < 16 or block_k < 16 or columns % block_n or depth % block_k:
        raise ValueError(
            f"the matmul kernel tiles K={depth} by {block_k} and N={columns} by {block_n}: "
            "both must divide evenly and be at least 16"
        )
    padded = -(-num_rows // BLOCK_T) * BLOCK_T
    x = jnp.pad(x, ((0, padded - num_rows), (0, 0)))
    kernel = functools.partial(
        _matmul_kernel, block_t=BLOCK_T, block_n=block_n, block_k=block_k, layout=layout
    )
    y = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, columns), x.dtype),
        grid=(padded // BLOCK_T, columns // block_n),
        launch=launch,
        interpret=interpret,
        name="matmul",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, w)
    return y[:num_rows]
