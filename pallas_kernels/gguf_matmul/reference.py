"""llama.cpp's block formats for the GPU: each GGUF block split once, at load, into planes the
Pallas kernels dequantize per tile, and the pure-JAX reference of their product.

The C++ kernel (cpu_kernels/gguf_matmul) reads the blocks as the file stores them; a GPU wants
aligned planes instead of 18- to 210-byte records with float16 scales in the middle. Every
format is affine per group of G values: W = code * scale + bias, with scale and bias the
values gguf's own dequantizer computes (`d`, `d * sc`, `-dmin * m`, ...). The planes
of a weight of N rows and K inputs:

    4-bit formats (Q4_0, Q4_1, Q4_K): codes u8[N, K / 2], packed as pallas_kernels/int4_matmul
        takes them (in each run of 32 values byte j holds value j and, high nibble, j + 16);
        Q4_K's nibbles are reordered to that layout (its bytes pair sub-blocks 2p and 2p + 1)
    5-, 6- and 8-bit formats (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0): codes i8[N, K], one per value,
        signed where the format centres them (Q5_0 q - 16, Q6_K q - 32, Q8_0) so that, as in
        gguf, the weight is one product d * q (bias 0)
    scale, bias: [N, K / G], G = 32 (Q6_K: 16); float16 for the 32-value formats (their d and m
        as the file stores them; Q4_0's -8 d is exact), float32 for the k-quants (d * sc)

so Q4_0 / Q4_1 cost 5 bits a value (the file 4.5 / 5), Q4_K 6 (4.5), Q5_0 / Q5_1 / Q8_0 9
(5.5 / 6 / 8.5), Q5_K and Q6_K 10 (5.5 / 6.56): the 5- and 6-bit formats pay for one byte a
value, which keeps the kernel's loads aligned. Values are gguf's exactly (a zero may differ in
sign): each product is the one its dequantizer rounds, and adding the bias rounds as gguf's
own sum or difference.

N: output rows, K: the contracted (input) axis, T: rows of x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.gguf_matmul.reference import FORMATS
from pallas_kernels.int4_matmul.reference import dequantize as int4_dequantize
from pallas_kernels.int4_matmul.reference import pack

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    """u8[..., 2] -> f32[...]: a float16 stored little-endian."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums -> (sc, m) u8[..., 8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _nibbles_by_run(q: np.ndarray) -> np.ndarray:
    """u8[..., 16] -> [..., 32]: a 32-value block's low nibbles (values 0-15), then high."""
    return np.concatenate([q & 0x0F, q >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's u8[..., 4] (a little-endian u32) -> bit j of it as u8[..., 32]."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def decode(fmt: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u8[N, row bytes] of `fmt` blocks -> (codes [N, K] u8 or i8, scale, bias [N, K / G])
    with W = codes * scale + bias per group (codes not yet packed)."""
    size = FORMATS[fmt][2]  # bytes per block
    n = raw.shape[0]
    b = np.asarray(raw, np.uint8).reshape(n, -1, size)  # [N, blocks, bytes]
    if fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(b[..., 0:2])
        if fmt == "Q8_0":
            codes, bias = b[..., 2:34].view(np.int8), np.zeros_like(d)
        elif fmt == "Q4_0":
            codes, bias = _nibbles_by_run(b[..., 2:18]), -8.0 * d
        elif fmt == "Q4_1":
            codes, bias = _nibbles_by_run(b[..., 4:20]), _f16(b[..., 2:4])
        elif fmt == "Q5_0":
            q = _nibbles_by_run(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
            codes, bias = (q.astype(np.int16) - 16).astype(np.int8), np.zeros_like(d)
        else:  # Q5_1
            q = _nibbles_by_run(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
            codes, bias = q.astype(np.int8), _f16(b[..., 2:4])
        return codes.reshape(n, -1), d.astype(np.float16), bias.astype(np.float16)
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _k_scales(b[..., 4:16])
        scale = d * sc.astype(np.float32)  # [N, blocks, 8]
        bias = -(dmin * mn.astype(np.float32))
        qs = b[..., 16:144] if fmt == "Q4_K" else b[..., 48:176]
        pairs = qs.reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        q = (pairs & 0x0F).reshape(n, -1, 8, 32)  # sub-block 2p: low nibbles, 2p + 1: high
        if fmt == "Q5_K":
            qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            q = q | ((qh & 1) << 4)
        codes = q.astype(np.uint8 if fmt == "Q4_K" else np.int8)
        return codes.reshape(n, -1), scale.reshape(n, -1), bias.reshape(n, -1)
    if fmt == "Q6_K":
        d = _f16(b[..., 208:210])[..., None]
        scale = d * b[..., 192:208].view(np.int8).astype(np.float32)  # [N, blocks, 16]
        ql = b[..., 0:128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        ql = (ql & 0x0F).reshape(n, -1, 2, 4, 32)
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        q = ql | ((qh & 3) << 4)  # [N, blocks, half, 4, 32]: value 128 half + 32 c + l
        codes = (q.astype(np.int16) - 32).astype(np.int8)
        return codes.reshape(n, -1), scale.reshape(n, -1), np.zeros_like(scale.reshape(n, -1))
    raise ValueError(f"no GPU planes for {fmt}")


def to_planes(fmt: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """u8[N, row bytes] of `fmt` blocks -> the kernel's (codes, scale, bias) planes."""
    codes, scale, bias = decode(fmt, raw)
    if fmt in FOUR_BIT:
        codes = pack(codes)
    return codes, scale, bias


def dequantize(codes, scale, bias):
    """The float32 weight [N, K] of planes (numpy or JAX, as given)."""
    if codes.dtype == np.uint8:  # 4-bit, packed
        return int4_dequantize(codes, scale, bias)
    xp = jnp if isinstance(codes, jax.Array) else np
    n, k = codes.shape
    q = codes.astype(xp.float32).reshape(n, scale.shape[1], -1)  # [N, K / G, G]
    w = q * scale.astype(xp.float32)[..., None] + bias.astype(xp.float32)[..., None]
    return w.reshape(n, k)


def gguf_matmul_reference(
    x: jax.Array,  # [T, K]
    codes: jax.Array,  # u8[N, K / 2] (4-bit formats) or i8[N, K]
    scale: jax.Array,  # f16 or f32[N, K / G]
    bias: jax.Array,  # f16 or f32[N, K / G]
) -> jax.Array:  # [T, N] in x's dtype
    """x @ W^T with W dequantized (in float32, then x's dtype)."""
    w = dequantize(codes, scale, bias).astype(x.dtype)
    return x @ w.T
