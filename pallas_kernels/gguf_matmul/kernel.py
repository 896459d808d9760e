"""x @ W^T for weights in llama.cpp's block formats, split into planes (reference.py), as
Pallas kernels (GPU) that dequantize each tile in registers.

The 4-bit formats' planes are pallas_kernels/int4_matmul's format, and go to that kernel. The
others (one signed byte a value) go to the byte kernel here: a program computes one [BT, BN]
tile of y and walks K one group of G values at a time,

    acc += x[:, group] @ (codes[:, group] * scale[:, g] + bias[:, g])^T

with codes [BN, G] the step's bytes and scale, bias [BN, 1] the group's, dequantized in float32
and never written to memory. Rows of x are padded to a multiple of BT.

T: rows of x, K: the contracted axis, N: outputs, G: the group size (32; Q6_K 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.int4_matmul.kernel import BLOCK_T, int4_matmul
from pallas_kernels.tiles import largest_power_of_two_divisor


def _byte_kernel(x_ref, codes_ref, scale_ref, bias_ref, y_ref, *, block_t, block_n, group):
    # x_ref [Tp, K]; codes_ref i8[N, K]; scale_ref, bias_ref [N, K / G]; y_ref [Tp, N]
    t, n = pl.program_id(0), pl.program_id(1)
    rows, cols = pl.ds(t * block_t, block_t), pl.ds(n * block_n, block_n)
    dtype = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def step(g, acc):
        values = pl.ds(g * group, group)
        q = codes_ref[cols, values].astype(jnp.float32)  # [BN, G]
        scale = scale_ref[cols, pl.ds(g, 1)].astype(jnp.float32)  # [BN, 1]
        bias = bias_ref[cols, pl.ds(g, 1)].astype(jnp.float32)
        w = (q * scale + bias).astype(dtype)
        return acc + jnp.dot(
            x_ref[rows, values], w.T, precision=precision, preferred_element_type=jnp.float32
        )

    groups = scale_ref.shape[1]
    acc = jax.lax.fori_loop(0, groups, step, jnp.zeros((block_t, block_n), jnp.float32))
    y_ref[rows, cols] = acc.astype(y_ref.dtype)


def byte_matmul(
    x: jax.Array,  # [T, K]
    codes: jax.Array,  # i8[N, K]
    scale: jax.Array,  # f16 or f32[N, K / G]
    bias: jax.Array,  # f16 or f32[N, K / G]
    *,
    interpret: bool = False,
    block_n: int | None = None,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # [T, N] in x's dtype
    num_rows, depth = x.shape
    columns = codes.shape[0]
    group = depth // scale.shape[1]
    block_n = block_n or largest_power_of_two_divisor(columns, 64)
    if block_n < 16 or columns % block_n or group < 16 or group * scale.shape[1] != depth:
        raise ValueError(
            f"the block-format kernel tiles N={columns} by {block_n} (at least 16, dividing it) "
            f"and K={depth} by groups of {group} (at least 16, dividing it)"
        )
    padded = -(-num_rows // BLOCK_T) * BLOCK_T
    kernel = functools.partial(_byte_kernel, block_t=BLOCK_T, block_n=block_n, group=group)
    y = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, columns), x.dtype),
        grid=(padded // BLOCK_T, columns // block_n),
        launch=launch,
        interpret=interpret,
        name="gguf_byte_matmul",
    )(jnp.pad(x, ((0, padded - num_rows), (0, 0))), codes, scale, bias)
    return y[:num_rows]


def gguf_matmul(
    x: jax.Array,  # [T, K]
    codes: jax.Array,  # u8[N, K / 2] (4-bit formats) or i8[N, K]
    scale: jax.Array,  # f16 or f32[N, K / G]
    bias: jax.Array,  # f16 or f32[N, K / G]
    *,
    interpret: bool = False,
    block_n: int | None = None,
) -> jax.Array:  # [T, N] in x's dtype
    """The Pallas kernels with the reference's signature (gguf_matmul_reference): the planes'
    codes dtype says which (known when tracing)."""
    if codes.dtype == np.uint8:
        return int4_matmul(x, codes, scale, bias, interpret=interpret, block_n=block_n)
    return byte_matmul(x, codes, scale, bias, interpret=interpret, block_n=block_n)
