"""Rotary position embeddings from a precomputed cos/sin cache (Hugging Face's rotate-half layout)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxinfer.arch_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[D / 2]; computed in float32 as transformers does, so angles match bit for bit."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the middle band blended.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(inv_freq: np.ndarray, dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, truncated correction
    range): extrapolated below beta_fast rotations over the original context, interpolated
    (divided by factor) above beta_slow, blended linearly between."""

    def correction_dim(rotations: float) -> float:
        length = scaling.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolated = (1 - ramp).astype(np.float32)
    interpolated = inv_freq / np.float32(scaling.factor)
    return (interpolated * (1 - extrapolated) + inv_freq * extrapolated).astype(np.float32)


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    return scaling.attention_factor if scaling is not None and scaling.rope_type == "yarn" else 1.0


def cos_sin_cache(
    max_positions: int, head_dim: int, theta: float, scaling: RopeScaling | None
) -> np.ndarray:
    """f32[max_positions, 2, D / 2]: cos and sin of every position's angles."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    scale = np.float32(attention_factor(scaling))
    return (np.stack([np.cos(angles), np.sin(angles)], axis=1) * scale).astype(np.float32)


def apply_rotary(x: jnp.ndarray, cos_sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [T, N, D] by cos_sin [T, 2, D / 2] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    cos = cos_sin[:, None, 0, :]  # [T, 1, D / 2]
    sin = cos_sin[:, None, 1, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_interleaved_rotary(
    x: jnp.ndarray,  # [T, ..., D]
    positions: jnp.ndarray,  # i32[T]
    theta: float,
    rotary_dim: int,
    scaling: RopeScaling | None = None,
    *,
    inverse: bool = False,
) -> jnp.ndarray:
    """DeepSeek-V4's RoPE: the trailing `rotary_dim` dims of each vector turned in pairs of
    neighbours (2i, 2i + 1) by position * theta^(-2i / rotary_dim) (as `scaling` adjusts it);
    `inverse` turns them back (the angle negated)."""
    inv_freq = jnp.asarray(inverse_frequencies(rotary_dim, theta, scaling))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, R / 2]
    angles = angles.reshape(angles.shape[0], *([1] * (x.ndim - 2)), -1)
    scale = attention_factor(scaling)
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
    if inverse:
        sin = -sin
    pairs = x[..., -rotary_dim:].astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    turned = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=-1)
    turned = turned.reshape(*x.shape[:-1], rotary_dim).astype(x.dtype)
    return jnp.concatenate([x[..., :-rotary_dim], turned], axis=-1)
