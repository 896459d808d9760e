"""Weights in llama.cpp's block formats (blocks of 32 values along the input axis) and their
product with float32 activations, in numpy and pure JAX: the reference for kernel.cc.

    Q4_1: qs u8[N, K / 2] (values j and j + 16 of a block in the low and high nibbles of its
          byte j), scales f32[N, K / 32, 2] (d, m): W = d * q + m
    Q8_0: qs i8[N, K], scales f32[N, K / 32] (d): W = d * q

N: output rows (leading axes allowed), K: the contracted (input) axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
FORMATS = ("Q4_1", "Q8_0")


def q4_1_values(qs: np.ndarray) -> np.ndarray:
    """u8[..., K / 2] -> u8[..., K]: each block's 4-bit values in order."""
    blocks = qs.reshape(*qs.shape[:-1], -1, BLOCK // 2)
    values = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., K / 32, 32]
    return values.reshape(*qs.shape[:-1], -1)


def dequantize(fmt: str, qs: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 weights [..., N, K], computed as the gguf package computes them (a float32
    multiply, then for Q4_1 a float32 add)."""
    if fmt == "Q4_1":
        q = q4_1_values(qs).astype(np.float32)
        q = q.reshape(*q.shape[:-1], -1, BLOCK)
        w = q * scales[..., 0:1] + scales[..., 1:2]
    elif fmt == "Q8_0":
        q = qs.astype(np.float32).reshape(*qs.shape[:-1], -1, BLOCK)
        w = q * scales[..., None]
    else:
        raise ValueError(f"block format must be one of {FORMATS}, got {fmt!r}")
    return w.reshape(*w.shape[:-2], -1)


def gguf_matmul_reference(
    fmt: str,
    x: jax.Array,  # f32[T, K]
    qs: np.ndarray,  # the weight's blocks, [N, ...]
    scales: np.ndarray,
) -> jax.Array:  # f32[T, N]
    """x @ W^T with W dequantized on the host."""
    w = jnp.asarray(dequantize(fmt, np.asarray(qs), np.asarray(scales)))
    return jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST)
