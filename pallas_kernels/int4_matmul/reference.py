"""4-bit weights in groups along the input axis, and their product with float activations, in
numpy and pure JAX: the format's definition and the reference for the kernels (the C++ one in
cpu_kernels/matmul, the Pallas one in kernel.py).

A weight [*out, K] (input axis last) is stored as

    qs:    u8[*out, K / 2]   4-bit values q in 0 .. 15, packed as llama.cpp's Q4_0 / Q4_1
                             blocks: in each run of 32 values, byte j holds value j in its low
                             nibble and value j + 16 in its high nibble
    scale: [*out, K / G]     float32 or float16, one per group of G consecutive inputs
    bias:  [*out, K / G]     float32 or float16

    W[..., g G + j] = q * scale[..., g] + bias[..., g]     (in float32)

G (the group size) is a multiple of 32 that divides K; it is K / scale.shape[-1]. Symmetric
int4 has bias = -8 scale; an integer zero point z gives bias = -z scale (AWQ, GPTQ; Q4_0 has
z = 8); llama.cpp's Q4_1 stores (d, m) = (scale, bias) directly.

N: output rows (leading axes allowed), K: the contracted axis, T: rows of x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # values per packed run
GROUP_SIZES = (32, 64, 128)  # the group sizes quantization at load offers


def pack(q: np.ndarray) -> np.ndarray:
    """u8[..., K] values 0 .. 15 -> u8[..., K / 2] in the packed layout."""
    q = np.asarray(q, np.uint8)
    runs = q.reshape(*q.shape[:-1], -1, 2, BLOCK // 2)  # [..., K / 32, 2, 16]
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*q.shape[:-1], -1)


def unpack(qs):
    """u8[..., K / 2] -> u8[..., K] (numpy or JAX, as given)."""
    xp = jnp if isinstance(qs, jax.Array) else np
    runs = qs.reshape(*qs.shape[:-1], -1, BLOCK // 2)
    values = xp.concatenate([runs & 0x0F, runs >> 4], axis=-1)  # [..., K / 32, 32]
    return values.reshape(*qs.shape[:-1], -1)


def group_size(qs, scale) -> int:
    return 2 * qs.shape[-1] // scale.shape[-1]


def dequantize(qs, scale, bias):
    """The float32 weight [..., N, K] (numpy or JAX, as given): q * scale + bias per group."""
    xp = jnp if isinstance(qs, jax.Array) else np
    size = group_size(qs, scale)
    q = unpack(qs).astype(xp.float32)
    q = q.reshape(*q.shape[:-1], -1, size)  # [..., N, K / G, G]
    w = q * scale.astype(xp.float32)[..., None] + bias.astype(xp.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1)


def int4_matmul_reference(
    x: jax.Array,  # [T, K]
    qs: jax.Array,  # u8[*out, K / 2]
    scale: jax.Array,  # [*out, K / G]
    bias: jax.Array,  # [*out, K / G]
) -> jax.Array:  # [T, *out] in x's dtype
    """x @ W^T with W dequantized (in float32, then x's dtype)."""
    w = dequantize(qs, scale, bias).astype(x.dtype)
    return jnp.tensordot(x, w, axes=((1,), (w.ndim - 1,)))


def quantize(w: np.ndarray, size: int, symmetric: bool, dtype=np.float16):
    """(qs, scale, bias) of a float weight [..., K] (input axis last) in groups of `size`.

    Asymmetric (the default at load): each group's own range, scale = (max - min) / 15 and
    bias = min (llama.cpp's Q4_1 grid). Symmetric: scale = max |w| / 7, bias = -8 scale. scale
    and bias are stored in `dtype` (float16: 5 bits a weight at group 32), and q is the nearest
    point of the stored grid, clipped to 0 .. 15."""
    w = np.asarray(w, np.float32)
    k = w.shape[-1]
    if size % BLOCK or k % size:
        raise ValueError(f"int4 groups of {size} need K a multiple of it (and of 32), got K={k}")
    groups = w.reshape(*w.shape[:-1], k // size, size)
    if symmetric:
        scale = np.max(np.abs(groups), axis=-1) / 7.0
        scale = np.where(scale > 0, scale, 1.0).astype(dtype)
        bias = (-8.0 * scale.astype(np.float32)).astype(dtype)
    else:
        lo, hi = np.min(groups, axis=-1), np.max(groups, axis=-1)
        scale = (hi - lo) / 15.0
        scale = np.where(scale > 0, scale, 1.0).astype(dtype)
        bias = lo.astype(dtype)
    s32, b32 = scale.astype(np.float32)[..., None], bias.astype(np.float32)[..., None]
    q = np.clip(np.rint((groups - b32) / s32), 0, 15).astype(np.uint8)
    return pack(q.reshape(w.shape)), scale, bias
