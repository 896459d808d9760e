"""A numpy writer of llama.cpp's Q4_K blocks for tests (the gguf package dequantizes Q4_K but
cannot quantize it). It follows ggml's block_q4_K layout; readers check their results against
gguf.quants.dequantize, not against this file.

A row of K values (K a multiple of 256) is K / 256 blocks of 144 bytes: float16 d and dmin,
12 bytes of 6-bit scales sc and mins m for the block's 8 groups of 32, then 128 bytes of
4-bit values q: W = d sc q - dmin m.
"""

from __future__ import annotations

import numpy as np


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """f32[N, K] -> u8[N, K / 256 * 144]: each group over [min(w, 0), max(w)]."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q4_K needs rows of a multiple of 256 values, got {k}")
    groups = np.asarray(w, np.float32).reshape(n, k // 256, 8, 32)
    low = np.minimum(groups.min(-1), 0.0)  # [N, S, 8]
    step, mins = (groups.max(-1) - low) / 15.0, -low
    d = (step.max(-1) / 63.0).astype(np.float16)  # [N, S]
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    sc = _six_bits(step, d)  # [N, S, 8]
    m = _six_bits(mins, dmin)
    scale = d.astype(np.float32)[..., None] * sc  # [N, S, 8]
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.rint((groups + offset[..., None]) / np.where(scale > 0, scale, 1.0)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, k // 256, 4, 2, 32)
    # byte l of chunk c: value 64 c + l (low nibble), value 64 c + 32 + l (high nibble)
    values = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // 256, 128)
    packed = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # [N, S, 12]
    head = np.stack([d, dmin], axis=-1).view(np.uint8)  # [N, S, 4]
    return np.concatenate([head, packed, values], axis=-1).reshape(n, -1)


def _six_bits(values: np.ndarray, unit: np.ndarray) -> np.ndarray:
    unit = unit.astype(np.float32)[..., None]
    return np.clip(np.rint(values / np.where(unit > 0, unit, 1.0)), 0, 63).astype(np.uint8)
