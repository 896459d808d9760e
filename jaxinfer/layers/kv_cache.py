"""The paged KV cache as the model sees it: values and, for a quantized cache, their scales,
one pytree threaded through the step (donated, updated in place).

Formats (EngineOptions.kv_cache_dtype; the math is in
pallas_kernels.ragged_paged_attention.kv_quant):

- "auto": the model dtype, no scales.
- "int8": one scale per token and KV head, f32[L, 2, NB, BS, K] beside the values in the same
  paged layout, so blocks, prefix sharing, preemption and copying work on both alike. Keys
  have outlier channels (a few channels many times the others, which would set every token's
  int8 step), so they are stored divided by a per-channel `key_smoothing` f32[L, K, D]
  measured at start-up, and the queries multiplied by it: q . k is unchanged
  (SmoothAttention, as in QServe).
- "fp8_e4m3" / "fp8_e5m2": one scale per layer, K or V, and KV head, f32[L, 2, K], fixed
  before serving (calibrated at start-up or read from the checkpoint).

L: layers, NB: blocks, BS: block size, K: KV heads, D: head dim, T: tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_quant import FP8_DTYPES, write_kv_quantized
from pallas_kernels.ragged_paged_attention.reference import write_kv_reference

KV_CACHE_DTYPES = ("auto", "int8", *FP8_DTYPES)

VALUE_AXES = ("layers", None, "blocks", None, "kv_heads", "head_dim")
SCALE_AXES = {  # sharded with their heads
    "int8": ("layers", None, "blocks", None, "kv_heads"),
    "fp8": ("layers", None, "kv_heads"),
}
SMOOTHING_AXES = ("layers", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class CacheConstants:
    """What a quantized cache fixes before serving (jaxinfer.engine.startup.kv_calibration)."""

    fp8_scales: jax.Array | None = None  # f32[L, 2, K]
    key_smoothing: jax.Array | None = None  # f32[L, K, D] (int8)


def value_dtype(kv_cache_dtype: str, model_dtype) -> jnp.dtype:
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype == "int8":
        return jnp.dtype(jnp.int8)
    return jnp.dtype(FP8_DTYPES[kv_cache_dtype])


def scale_kind(kv_cache_dtype: str) -> str | None:
    """The scales a format keeps: "int8" (per token), "fp8" (per head) or None."""
    if kv_cache_dtype == "auto":
        return None
    return "int8" if kv_cache_dtype == "int8" else "fp8"


def bytes_per_token(
    kv_cache_dtype: str, model_dtype, num_layers: int, num_kv_heads: int, head_dim: int
) -> int:
    """Bytes one token's K and V take in the cache over all layers, scales included."""
    itemsize = value_dtype(kv_cache_dtype, model_dtype).itemsize
    scale_bytes = 4 if kv_cache_dtype == "int8" else 0  # fp8's per-head scales: negligible
    return 2 * num_layers * num_kv_heads * (head_dim * itemsize + scale_bytes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache in one of the formats above; its arrays are what the step donates."""

    values: jax.Array  # [L, 2, NB, BS, K, D]: the model dtype, int8 or fp8
    scales: jax.Array | None = None  # int8: f32[L, 2, NB, BS, K]; fp8: f32[L, 2, K]
    key_smoothing: jax.Array | None = None  # f32[L, K, D]: keys stored divided by it

    def write(
        self,
        layer: jax.Array,  # i32[]
        k: jax.Array,  # [T, K, D]
        v: jax.Array,  # [T, K, D]
        slot_mapping: jax.Array,  # i32[T]
    ) -> KVCache:
        """This step's K/V scattered into one layer (quantized on the way for int8 / fp8)."""
        if self.scales is None:
            return KVCache(write_kv_reference(self.values, layer, k, v, slot_mapping))
        if self.key_smoothing is not None:
            k = k / self.key_smoothing[layer]
        values, scales = write_kv_quantized(self.values, self.scales, layer, k, v, slot_mapping)
        return dataclasses.replace(self, values=values, scales=scales)

    def queries(self, q: jax.Array, layer: jax.Array) -> jax.Array:  # [T, H, D]
        """The queries the kernels take: multiplied by the key smoothing of their KV head."""
        if self.key_smoothing is None:
            return q
        smoothing = self.key_smoothing[layer]  # [K, D]
        grouped = q.reshape(q.shape[0], smoothing.shape[0], -1, q.shape[2])  # [T, K, G, D]
        return (grouped * smoothing[:, None, :]).astype(q.dtype).reshape(q.shape)

    def attention_kwargs(self) -> dict:
        """What an attention kernel takes besides the values: the scales, when quantized (so
        a kernel registered for an unquantized cache keeps its signature)."""
        return {} if self.scales is None else {"kv_scales": self.scales}
