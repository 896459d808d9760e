"""The formats of a quantized KV cache, in pure JAX: what the write path stores and what the
attention kernels' read path must give back.

- int8: symmetric, one scale per token and KV head (the max |x| over the head dim / 127), so a
  token whose keys have outlier channels costs only its own precision. Stored beside the cache
  in its paged layout: values i8[..., BS, K, D], scales f32[..., BS, K].
- fp8 (e4m3, e5m2): one scale per KV head for the whole cache (measured at calibration or
  read from a checkpoint's k_scale / v_scale), values cast after dividing by it and clipping
  to the format's largest finite value (a cast alone would give inf or NaN).

Dequantized, a value is q * scale. T: tokens, K: KV heads, D: head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127.0
FP8_DTYPES = {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:  # (i8[T, K, D], f32[T, K])
    """Symmetric int8 with a scale per token and head; an all-zero row gets scale 1."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)  # [T, K]
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def quantize_fp8(x: jax.Array, scale: jax.Array, kind: str) -> jax.Array:  # fp8[T, K, D]
    """x / scale (f32[K], one per head), clipped to the format's range, cast to fp8."""
    dtype = FP8_DTYPES[kind]
    limit = float(jnp.finfo(dtype).max)
    scaled = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(scaled, -limit, limit).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:  # f32[T, K, D]
    """q * scale: scale f32[T, K] (int8, per token and head) or f32[K] (fp8, per head)."""
    return q.astype(jnp.float32) * scale[..., None]


def fp8_scale(x: jax.Array, kind: str) -> jax.Array:  # f32[K]
    """A per-head scale that maps the largest |x| seen (x: [T, K, D], calibration tokens) to
    the format's largest finite value."""
    limit = float(jnp.finfo(FP8_DTYPES[kind]).max)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 2))  # [K]
    return jnp.where(amax > 0, amax / limit, 1.0)
