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


def fp8_scale(amax: jax.Array, kind: str, headroom: float = 1.0) -> jax.Array:  # f32[...]
    """Scales that map amax (the largest |x| seen per head, e.g. over calibration tokens)
    times `headroom` to the format's largest finite value; 1 where amax is 0."""
    limit = float(jnp.finfo(FP8_DTYPES[kind]).max)
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.where(amax > 0, amax * headroom / limit, 1.0)


SCALE_LAYOUTS = {"int8": "token", "fp8_e4m3": "head", "fp8_e5m2": "head"}  # by format name


def check_scale_layout(layout: str | None, kv_scales: jax.Array | None, kv_cache: jax.Array):
    """Checks that `kv_scales` are laid out as `layout` says (the caller's settled format; a
    kernel never guesses it from the arrays): "token" f32[(L,) 2, NB, BS, K] beside int8
    values, "head" f32[(L,) 2, K] beside fp8 ones, or None and no scales."""
    if (layout is None) != (kv_scales is None):
        raise ValueError("kv_scales and kv_scale_layout come together (a quantized cache)")
    if layout is None:
        return
    if layout not in ("token", "head"):
        raise ValueError(f"kv_scale_layout must be 'token' or 'head', got {layout!r}")
    expected = kv_cache.ndim - 1 if layout == "token" else kv_cache.ndim - 3
    if kv_scales.ndim != expected:
        raise ValueError(
            f"kv_scales {kv_scales.shape} are not per-{layout} scales of a cache {kv_cache.shape}"
        )


def dequantize_cache(kv_cache: jax.Array, kv_scales: jax.Array, layout: str) -> jax.Array:
    """The float32 cache a quantized one stands for: [(L,) 2, NB, BS, K, D]."""
    check_scale_layout(layout, kv_scales, kv_cache)
    values = kv_cache.astype(jnp.float32)
    if layout == "token":
        return values * kv_scales[..., None]
    return values * kv_scales[..., None, None, :, None]  # [(L,) 2, K] over NB, BS and D


def write_kv_quantized(
    kv_cache: jax.Array,  # [L, 2, NB, BS, K, D], int8 or fp8
    kv_scales: jax.Array,  # f32[L, 2, NB, BS, K] (int8) or f32[L, 2, K] (fp8)
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block 0
    kind: str,  # the format: "int8", "fp8_e4m3" or "fp8_e5m2"
) -> tuple[jax.Array, jax.Array]:  # (kv_cache, kv_scales)
    """Quantizes this step's K/V and scatters them into one layer of the cache: int8 values
    with their per-token scales into the same slots; fp8 values under the cache's fixed
    per-head scales (which are left as they are)."""
    check_scale_layout(SCALE_LAYOUTS[kind], kv_scales, kv_cache)
    block_size = kv_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for index, x in enumerate((k, v)):
        if kind == "int8":
            q, scale = quantize_int8(x)
            kv_scales = kv_scales.at[layer, index, blocks, offsets].set(scale)
        else:
            q = quantize_fp8(x, kv_scales[layer, index], kind)
        kv_cache = kv_cache.at[layer, index, blocks, offsets].set(q)
    return kv_cache, kv_scales


def quantize_cache(
    kv_cache: jax.Array, kind: str
) -> tuple[jax.Array, jax.Array]:  # (values, kv_scales)
    """A whole float cache [(L,) 2, NB, BS, K, D] in format `kind` ("int8", "fp8_e4m3",
    "fp8_e5m2"), fp8 scaled by its own largest |K| and |V| per head (for tests and
    benchmarks; the engine quantizes in the write path)."""
    shape = kv_cache.shape
    flat = kv_cache.reshape(-1, *shape[-2:])  # [N, K, D]
    if kind == "int8":
        values, scales = quantize_int8(flat)
        return values.reshape(shape), scales.reshape(shape[:-1])
    scales = fp8_scale(jnp.max(jnp.abs(kv_cache.astype(jnp.float32)), axis=(-4, -3, -1)), kind)
    per_part = scales.reshape(-1, shape[-2])  # [(L *) 2, K]
    parts = kv_cache.reshape(per_part.shape[0], -1, *shape[-2:])
    values = jax.vmap(lambda x, s: quantize_fp8(x, s, kind))(parts, per_part)
    return values.reshape(shape), scales
