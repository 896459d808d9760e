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

from pallas_kernels.ragged_paged_attention.kv_quant import (
    FP8_DTYPES,
    SCALE_LAYOUTS,
    write_kv_quantized,
)
from pallas_kernels.ragged_paged_attention.reference import write_kv_reference

KV_CACHE_DTYPES = ("auto", "int8", *FP8_DTYPES)

VALUE_AXES = ("layers", None, "blocks", None, "kv_heads", "head_dim")
SCALE_AXES = {  # by scale layout; sharded with their heads
    "token": ("layers", None, "blocks", None, "kv_heads"),
    "head": ("layers", None, "kv_heads"),
}
SMOOTHING_AXES = ("layers", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class CacheConstants:
    """What a quantized cache fixes before serving (jaxinfer.engine.startup.kv_calibration)."""

    fp8_scales: jax.Array | None = None  # f32[L, 2, K]
    key_smoothing: jax.Array | None = None  # f32[L, K, D] (int8)


@dataclasses.dataclass(frozen=True)
class KVCacheFormat:
    """A KV-cache format, settled once from EngineOptions.kv_cache_dtype and the model dtype
    (EngineConfig.cache.kv_format): what the cache stores, what scales beside it, what it
    costs. The cache, calibration, the kernels (through KVCache), the kernel probe and the
    metrics take it; nothing reads the format back from the arrays."""

    name: str  # "auto", "int8", "fp8_e4m3" or "fp8_e5m2"
    value_dtype: jnp.dtype  # what the values are stored as
    scale_layout: str | None  # "token" f32[L, 2, NB, BS, K], "head" f32[L, 2, K], or None

    @classmethod
    def resolve(cls, kv_cache_dtype: str, model_dtype) -> KVCacheFormat:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
            )
        if kv_cache_dtype == "auto":
            return cls("auto", jnp.dtype(model_dtype), None)
        dtype = jnp.int8 if kv_cache_dtype == "int8" else FP8_DTYPES[kv_cache_dtype]
        return cls(kv_cache_dtype, jnp.dtype(dtype), SCALE_LAYOUTS[kv_cache_dtype])

    @property
    def quantized(self) -> bool:
        return self.scale_layout is not None

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token's K and V take in the cache over all layers, scales included
        (fp8's per-head scales are negligible)."""
        scale_bytes = 4 if self.scale_layout == "token" else 0
        return 2 * num_layers * num_kv_heads * (head_dim * self.value_dtype.itemsize + scale_bytes)

    def bytes_per_block(
        self, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int
    ) -> int:
        return block_size * self.bytes_per_token(num_layers, num_kv_heads, head_dim)

    def allocate(
        self,
        shape: tuple[int, ...],  # [L, 2, NB, BS, K, D]
        partitioner,  # jaxinfer.parallel.sharding.Partitioner
        constants: CacheConstants,
    ) -> KVCache:
        """The empty cache in this format: values and, for int8, zero scales and the key
        smoothing; an fp8 cache takes its fixed per-head scales."""
        values = partitioner.zeros(shape, self.value_dtype, VALUE_AXES)
        if self.scale_layout is None:
            return KVCache(values)
        if self.scale_layout == "token":
            scales = partitioner.zeros(shape[:-1], jnp.float32, SCALE_AXES["token"])
            smoothing = constants.key_smoothing
            if smoothing is not None and smoothing.shape != (shape[0], shape[4], shape[5]):
                raise ValueError(f"key smoothing must be f32[L, K, D], got {smoothing.shape}")
            return KVCache(values, scales, smoothing, kind=self.name)
        scales = constants.fp8_scales
        if scales is None or scales.shape != (shape[0], 2, shape[4]):
            raise ValueError(f"an {self.name} KV cache needs scales f32[L, 2, K]")
        return KVCache(values, scales, kind=self.name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache in one of the formats above; its arrays are what the step donates."""

    values: jax.Array  # [L, 2, NB, BS, K, D]: the model dtype, int8 or fp8
    scales: jax.Array | None = None  # int8: f32[L, 2, NB, BS, K]; fp8: f32[L, 2, K]
    key_smoothing: jax.Array | None = None  # f32[L, K, D]: keys stored divided by it
    kind: str = dataclasses.field(default="auto", metadata={"static": True})  # the format's name

    @property
    def scale_layout(self) -> str | None:
        return None if self.scales is None else SCALE_LAYOUTS[self.kind]

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
        values, scales = write_kv_quantized(
            self.values, self.scales, layer, k, v, slot_mapping, self.kind
        )
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
        if self.scales is None:
            return {}
        return {"kv_scales": self.scales, "kv_scale_layout": self.scale_layout}
