"""x @ W^T for 4-bit weights in groups (format: reference.py) as a Pallas kernel (GPU).

A program computes one [BT, BN] tile of y and walks K one group at a time. The packed bytes
of a group hold its values j (low nibbles) and j + 16 (high nibbles) of each run of 32, so the
kernel never interleaves nibbles: x is split once, outside, into the columns the low nibbles
multiply (x_lo [T, K / 2]) and those the high ones do (x_hi), and each step is

    acc += x_lo[:, group] @ (lo * scale + bias)^T + x_hi[:, group] @ (hi * scale + bias)^T

with lo, hi [BN, G / 2] the step's nibbles and scale, bias [BN, 1] the group's: the weight
tile is dequantized in registers, in float32, and never written to memory. Rows of x are
padded to a multiple of BT.

T: rows of x, K: the contracted axis, N: outputs, G: the group size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.int4_matmul.reference import BLOCK, group_size
from pallas_kernels.tiles import largest_power_of_two_divisor

BLOCK_T = 16  # rows per program: Triton's smallest dot


def split_by_nibble(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (x_lo, x_hi) [T, K / 2]: the values each run's low and high nibbles take."""
    runs = x.reshape(x.shape[0], -1, 2, BLOCK // 2)
    return runs[:, :, 0].reshape(x.shape[0], -1), runs[:, :, 1].reshape(x.shape[0], -1)


def _kernel(x_lo_ref, x_hi_ref, qs_ref, scale_ref, bias_ref, y_ref, *, block_t, block_n, half):
    # x_lo_ref, x_hi_ref [Tp, K / 2]; qs_ref u8[N, K / 2]; scale_ref, bias_ref [N, K / G];
    # y_ref [Tp, N]. half = G / 2: the packed columns of one group.
    t, n = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(t * block_t, block_t), pl.ds(n * block_n, block_n)
    dtype = x_lo_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def step(g, acc):
        packed = pl.ds(g * half, half)
        q = qs_ref[cols, packed].astype(jnp.int32)  # [BN, G / 2]
        scale = scale_ref[cols, pl.ds(g, 1)].astype(jnp.float32)  # [BN, 1]
        bias = bias_ref[cols, pl.ds(g, 1)].astype(jnp.float32)
        w_lo = ((q & 0x0F).astype(jnp.float32) * scale + bias).astype(dtype)
        w_hi = ((q >> 4).astype(jnp.float32) * scale + bias).astype(dtype)
        for x_ref, w in ((x_lo_ref, w_lo), (x_hi_ref, w_hi)):
            acc = acc + jnp.dot(
                x_ref[rows, packed], w.T, precision=precision, preferred_element_type=jnp.float32
            )
        return acc

    groups = scale_ref.shape[1]
    acc = jax.lax.fori_loop(0, groups, step, jnp.zeros((block_t, block_n), jnp.float32))
    y_ref[rows, cols] = acc.astype(y_ref.dtype)


def int4_matmul(
    x: jax.Array,  # [T, K]
    qs: jax.Array,  # u8[*out, K / 2]
    scale: jax.Array,  # [*out, K / G] float32 or float16
    bias: jax.Array,  # [*out, K / G]
    *,
    interpret: bool = False,
    block_n: int | None = None,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # [T, *out] in x's dtype
    """The Pallas kernel with the reference's signature (int4_matmul_reference)."""
    num_rows, depth = x.shape
    out = qs.shape[:-1]
    qs = qs.reshape(-1, qs.shape[-1])
    scale, bias = scale.reshape(qs.shape[0], -1), bias.reshape(qs.shape[0], -1)
    columns = qs.shape[0]
    size = group_size(qs, scale)
    block_n = block_n or largest_power_of_two_divisor(columns, 64)
    if block_n < 16 or columns % block_n or size % BLOCK or depth % size:
        raise ValueError(
            f"the int4 kernel tiles N={columns} by {block_n} (at least 16, dividing it) and K="
            f"{depth} by groups of {size} (a multiple of {BLOCK} dividing K)"
        )
    padded = -(-num_rows // BLOCK_T) * BLOCK_T
    x_lo, x_hi = split_by_nibble(jnp.pad(x, ((0, padded - num_rows), (0, 0))))
    kernel = functools.partial(_kernel, block_t=BLOCK_T, block_n=block_n, half=size // 2)
    y = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, columns), x.dtype),
        grid=(padded // BLOCK_T, columns // block_n),
        launch=launch,
        interpret=interpret,
        name="int4_matmul",
    )(x_lo, x_hi, qs, scale, bias)
    return y[:num_rows].reshape(num_rows, *out)
