"""Residual add and RMSNorm fused in one Pallas kernel.

T: tokens, E: hidden size, BE: the tile a program reads at a time.

A program owns one token's row. Pass one walks the row in tiles of BE, adding the sublayer's
output to the residual and summing squares in float32; pass two recomputes each tile's sum (a
re-read of the inputs is cheaper than a round trip through memory that other threads of the
program wrote), writes it as the new residual and writes the normalized, weighted row. Each
element of x and residual is read twice and each output written once, against three reads and
two writes (plus launches) for an add kernel followed by a norm kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.tiles import largest_power_of_two_divisor


def _add_rms_norm_kernel(x_ref, res_ref, w_ref, out_ref, sum_ref, *, block_e, eps):
    # x_ref, res_ref, out_ref, sum_ref [T, E]; w_ref [E]
    row = pl.program_id(0)
    hidden = x_ref.shape[1]
    tiles = hidden // block_e

    def total(k):
        cols = pl.ds(k * block_e, block_e)
        s = x_ref[row, cols].astype(jnp.float32) + res_ref[row, cols].astype(jnp.float32)
        return s.astype(sum_ref.dtype).astype(jnp.float32)  # rounded as the reference's sum

    def squares(k, acc):
        s = total(k)
        return acc + (s * s).sum()

    inv_rms = jax.lax.rsqrt(jax.lax.fori_loop(0, tiles, squares, jnp.float32(0.0)) / hidden + eps)

    def write(k, carry):
        cols = pl.ds(k * block_e, block_e)
        s = total(k)
        sum_ref[row, cols] = s.astype(sum_ref.dtype)
        normed = (s * inv_rms).astype(out_ref.dtype)
        out_ref[row, cols] = w_ref[cols] * normed
        return carry

    jax.lax.fori_loop(0, tiles, write, 0)


def add_rms_norm(
    x: jax.Array,  # [T, E]
    residual: jax.Array,  # [T, E]
    weight: jax.Array,  # [E]
    *,
    eps: float,
    interpret: bool = False,
    block_e: int | None = None,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> tuple[jax.Array, jax.Array]:  # (normed [T, E], x + residual [T, E])
    """The Pallas kernel with the reference's signature."""
    num_tokens, hidden = x.shape
    block_e = block_e or largest_power_of_two_divisor(hidden, 1024)
    if block_e < 16 or hidden % block_e:
        raise ValueError(f"add_rms_norm tiles E={hidden} by {block_e}: it must divide, >= 16")
    kernel = functools.partial(_add_rms_norm_kernel, block_e=block_e, eps=eps)
    shape = jax.ShapeDtypeStruct((num_tokens, hidden), x.dtype)
    return gpu_lowering.call(
        kernel,
        out_shape=(shape, shape),
        grid=(num_tokens,),
        launch=launch,
        interpret=interpret,
        name="add_rms_norm",
    )(x, residual, weight)
