"""What the runner keeps on the device besides the parameters: the KV cache, allocated for
the config, LoRA adapters' slots, and per-layer copies of stacked parameters (per-layer
execution)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.config import EngineConfig
from jaxinfer.layers import compressed_cache, lora
from jaxinfer.layers.kv_cache import CacheConstants, KVCache
from jaxinfer.layers.state_cache import CONV_AXES, DELTA_AXES, HybridCache, state_shapes
from jaxinfer.parallel.sharding import Partitioner


def allocate_kv_cache(
    config: EngineConfig,
    partitioner: Partitioner,
    constants: CacheConstants = CacheConstants(),  # noqa: B008 (frozen)
) -> KVCache | HybridCache | compressed_cache.CompressedCache:
    """The empty cache in config.cache.kv_format: values [L, 2, NB, BS, K, D] and the
    format's scales (jaxinfer.layers.kv_cache); a hybrid model's for its attention layers,
    with its linear layers' state slots beside it, one per request row and per prefix
    checkpoint (after the rows'); DeepSeek-V4's (jaxinfer.layers.compressed_cache)."""
    arch, cache = config.model.arch, config.cache
    if arch.compressed is not None:  # DeepSeek-V4's
        return compressed_cache.allocate(
            arch,
            cache.num_blocks,
            cache.block_size,
            dict(cache.entry_blocks),
            config.scheduler.max_num_seqs + 1,
            config.model.max_model_len,
            config.model.dtype,
            zeros=partitioner.zeros,  # whole on every device
            num_speculative_tokens=config.scheduler.num_speculative_tokens,
            mtp_tokens=(
                config.scheduler.max_num_batched_tokens if config.speculative.method == "mtp" else 0
            ),
        )
    shape = (
        arch.num_kv_layers,
        2,
        cache.num_blocks,
        cache.block_size,
        arch.num_key_value_heads,
        arch.head_dim,
    )
    kv = cache.kv_format.allocate(shape, partitioner, constants)
    if arch.hybrid is None:
        return kv
    conv, delta = state_shapes(arch, config.scheduler.max_num_seqs + 1 + cache.state_checkpoints)
    return HybridCache(
        kv,
        partitioner.zeros(conv, config.model.dtype, CONV_AXES),
        partitioner.zeros(delta, jnp.float32, DELTA_AXES),
    )


def layer_of(stacked: jax.Array, layer: int, partitioner: Partitioner) -> jax.Array:
    """Layer `layer` of a stacked [L, ...] array in its own buffer, split as the stack is."""
    spec = stacked.sharding.spec[1:]  # without the [L] axis
    return jax.device_put(stacked[layer], NamedSharding(partitioner.mesh, PartitionSpec(*spec)))


def allocate_lora(config: EngineConfig, partitioner: Partitioner) -> lora.LoraWeights:
    """Empty LoRA adapter slots for config.lora, in the model's dtype."""
    slots = config.lora
    return lora.allocate(
        config.model.arch, slots.max_loras, slots.max_rank, config.model.dtype, partitioner
    )
