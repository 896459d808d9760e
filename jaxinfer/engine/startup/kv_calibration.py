"""What a quantized KV cache fixes before serving, measured by prefilling a few built-in
prompts into an unquantized cache (or read from the checkpoint):

- fp8: one scale per layer, K or V, and KV head: the checkpoint's k_scale / v_scale when it
  carries them, else each head's largest |K| and |V| over the prompts times HEADROOM. A scale
  of 1.0 (vLLM's default without calibration) clips every key beyond fp8's range (e4m3 ends at
  448). Values beyond what calibration saw are clipped too, hence the headroom; fp8's relative
  precision does not depend on magnitude (down to its subnormals), so it costs almost nothing.
- int8: the key smoothing (jaxinfer.layers.kv_cache): each key channel's largest |K| over the
  prompts, relative to its head's mean, so that keys divided by it have channels of one size.

L: layers, K: KV heads, D: head dim, NB: blocks, BS: block size, T: tokens.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.kv_cache import SCALE_AXES, SMOOTHING_AXES, CacheConstants, KVCache
from jaxinfer.model_loader.safetensors_loader import load_kv_scales
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.parallel.sharding import Partitioner
from jaxinfer.tokenizer import TokenizerWrapper
from pallas_kernels.ragged_paged_attention.kv_quant import fp8_scale

logger = logging.getLogger(__name__)

HEADROOM = 4.0
# A channel's smoothing is at least this share of its head's largest (a channel calibration
# saw near zero must not blow up when it is not).
MIN_SMOOTHING = 1e-2
CALIBRATION_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden screw press.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = "
    "len(items) // 2\n    return merge(merge_sort(items[:middle]), merge_sort(items[middle:]))",
    "Q: A train leaves at 14:05 and arrives at 17:50. How long is the journey?\nA: 3 hours "
    "and 45 minutes. Q: What is 12% of 250? A: 30.",
    "User: Write a short, friendly email inviting the team to a picnic on Saturday.\n"
    "Assistant: Hi everyone! Let's celebrate the end of the quarter with a picnic...",
)


def calibrate(
    config: EngineConfig,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kernels: ModelKernels,
    partitioner: Partitioner,
    tokenizer: TokenizerWrapper,
) -> CacheConstants:
    """The constants config.cache.kv_format needs (none unquantized), placed with the cache's
    heads."""
    kind = config.cache.kv_format.name
    if not config.cache.kv_format.quantized:
        return CacheConstants()
    arch = config.model.arch
    checkpoint = None
    if kind != "int8":
        checkpoint = load_kv_scales(config.model.path, arch, config.parallel.kv_replicas)
    if checkpoint is not None:
        scales = jnp.asarray(checkpoint)
        source = "the checkpoint's k_scale / v_scale"
    else:
        prompts = [tokenizer.encode(text) for text in CALIBRATION_TEXTS]
        amax = measure_kv_amax(config, graphdef, state, kernels, partitioner, prompts)
        source = f"calibration over {sum(map(len, prompts))} tokens"
        if kind == "int8":
            smoothing = key_smoothing(amax[:, 0])
            logger.info(
                "int8 KV cache: key smoothing from %s (largest channel / mean: %.1f)",
                source,
                float(jnp.max(smoothing)),
            )
            return CacheConstants(key_smoothing=partitioner.place(smoothing, SMOOTHING_AXES))
        scales = fp8_scale(jnp.max(amax, axis=-1) * HEADROOM, kind)
    logger.info(
        "%s KV cache: scales from %s: keys %.3g-%.3g, values %.3g-%.3g",
        kind,
        source,
        float(scales[:, 0].min()),
        float(scales[:, 0].max()),
        float(scales[:, 1].min()),
        float(scales[:, 1].max()),
    )
    return CacheConstants(fp8_scales=partitioner.place(scales, SCALE_AXES["head"]))


def key_smoothing(amax: jax.Array) -> jax.Array:  # f32[L, K, D]
    """Each key channel's largest |K| (amax f32[L, K, D]) over its head's mean, floored at
    MIN_SMOOTHING of the head's largest."""
    floor = MIN_SMOOTHING * jnp.max(amax, axis=-1, keepdims=True)
    amax = jnp.maximum(amax, jnp.maximum(floor, 1e-6))
    return (amax / jnp.mean(amax, axis=-1, keepdims=True)).astype(jnp.float32)


def measure_kv_amax(
    config: EngineConfig,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    kernels: ModelKernels,
    partitioner: Partitioner,
    prompts: list[list[int]],
) -> jax.Array:  # f32[L, 2, K, D]
    """The largest |K| and |V| of each layer, head and channel over the prompts, prefilled
    together into an unquantized cache of just their blocks."""
    arch, bs = config.model.arch, config.cache.block_size
    batch, num_blocks = prefill_batch(prompts, bs)
    values = jnp.zeros(
        (arch.num_hidden_layers, 2, num_blocks, bs, arch.num_key_value_heads, arch.head_dim),
        config.model.dtype,
    )

    @jax.jit
    def run(state, values, batch):
        model = nnx.merge(graphdef, state)
        cache, _ = model.hidden_states(
            KVCache(values), batch, kernels=kernels, partitioner=partitioner
        )
        return jnp.max(jnp.abs(cache.values.astype(jnp.float32)), axis=(2, 3))

    return run(state, values, batch)


def prefill_batch(prompts: list[list[int]], block_size: int) -> tuple[BatchInputs, int]:
    """One flat batch prefilling every prompt from position 0 into blocks of its own (block
    0 stays the null block); the number of blocks it uses."""
    tokens, positions, slots, tables, lens = [], [], [], [], []
    next_block = 1
    max_blocks = max(-(-len(p) // block_size) for p in prompts)
    for prompt in prompts:
        count = -(-len(prompt) // block_size)
        blocks = np.arange(next_block, next_block + count)
        next_block += count
        pos = np.arange(len(prompt))
        tokens.append(np.asarray(prompt, np.int32))
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        tables.append(np.pad(blocks, (0, max_blocks - count)))
        lens.append(len(prompt))
    batch = BatchInputs(
        token_ids=np.concatenate(tokens).astype(np.int32),
        positions=np.concatenate(positions).astype(np.int32),
        slot_mapping=np.concatenate(slots).astype(np.int32),
        block_tables=np.stack(tables).astype(np.int32),
        seq_lens=np.asarray(lens, np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        logits_indices=np.zeros(1, np.int32),
        num_seqs=np.asarray([len(prompts)], np.int32),
    )
    return batch, next_block
