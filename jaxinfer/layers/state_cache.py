"""A hybrid model's cache (jaxinfer.models.qwen3_5): the paged KV cache of its attention
layers and, beside it, each request's recurrent state in every linear-attention layer, one
pytree threaded through the step (donated, updated in place).

The states live in slots by request row: slot r is the state of the request holding device
row r (the rows the batch builder's RowTable hands out, the last one the padding requests'),
so a request keeps its slot for as long as it runs. A request whose step starts at position
0 (admitted, or recomputed after a preemption) starts from zeros, whatever its slot held;
every later chunk and decode continues from the slot.

La / Ll: attention / linear layers, S: slots (rows), C: convolution channels, K: its width,
Hv: value heads, Dk / Dv: key / value head dims, R: requests.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.arch_config import LINEAR_ATTENTION, LlamaConfig
from jaxinfer.layers.kv_cache import KVCache
from pallas_kernels.gated_delta.reference import StateBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridCache:
    kv: KVCache  # [La, 2, NB, BS, K, D]
    conv: jax.Array  # [Ll, S, C, K - 1], each request's last convolution inputs
    delta: jax.Array  # f32[Ll, S, Hv, Dk, Dv], each request's delta-rule state


def state_shapes(arch: LlamaConfig, num_slots: int) -> tuple[tuple, tuple]:
    """The shapes of the convolution and delta-rule states (HybridCache.conv, .delta)."""
    hybrid = arch.hybrid
    linear, layers = hybrid.linear, hybrid.count(LINEAR_ATTENTION)
    conv = (layers, num_slots, linear.conv_channels, linear.conv_kernel - 1)
    delta = (layers, num_slots, linear.num_v_heads, linear.k_head_dim, linear.v_head_dim)
    return conv, delta


# split by the linear layers' key-head groups, as their weights are (tensor parallelism)
CONV_AXES = (None, None, "linear_heads", None)
DELTA_AXES = (None, None, "linear_heads", None, None)


def state_bytes_per_slot(arch: LlamaConfig, dtype) -> int:
    """Bytes one request's states take over all linear layers."""
    conv, delta = state_shapes(arch, 1)
    return math.prod(conv) * jnp.dtype(dtype).itemsize + math.prod(delta) * 4


def state_batch(
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    state_rows: jax.Array,  # i32[R]
    num_seqs: jax.Array,  # i32[1]
) -> StateBatch:
    """Each request's state slot, and whether it starts fresh (its first token this step is
    at position 0)."""
    first = jnp.clip(query_start_loc[:-1], 0, positions.shape[0] - 1)
    return StateBatch(query_start_loc, state_rows, positions[first] == 0, num_seqs)


def copy_slots(
    cache: HybridCache,
    sources: jax.Array,  # i32[U]
    targets: jax.Array,  # i32[U]
) -> HybridCache:
    """Every linear layer's states of slots `sources` copied into slots `targets` (a
    request's states kept at a block boundary, or restored from there: jaxinfer.engine
    .scheduling.state_checkpoints). All are read before any is written."""
    conv = cache.conv.at[:, targets].set(cache.conv[:, sources])
    delta = cache.delta.at[:, targets].set(cache.delta[:, sources])
    return HybridCache(cache.kv, conv, delta)
