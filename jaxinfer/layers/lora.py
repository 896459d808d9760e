"""LoRA adapters on the device: every resident adapter's pairs in fixed slots (S-LoRA's
layout), and their products added to a decoder layer's projections, rows of many adapters in
one batched kernel call per target (the kernel registry's "lora": pallas_kernels.lora,
cpu_kernels.lora).

The slots have fixed shapes, whatever adapters are loaded: a stack per target module of
shrinks a [L, S, R, I] and expands b [L, S, R, O] (S: max_loras, R: max_lora_rank, smaller
ranks and absent targets zero), so loading an adapter is a write into its slot and nothing
is compiled again. A step's tokens each carry their request's slot (BatchInputs.lora_slots,
-1 for the base model). The targets' products are added to the fused projections' outputs
(q, k, v into QKV's [T, K, G + 2, D]; gate and up into [T, 2, I]), after the projection of
whatever format the base weight has (float, int8, int4, GGUF blocks).

T: tokens, L: layers, E: hidden size, I: intermediate size, K: kv heads, G: query heads per
kv head, D: head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.arch_config import LlamaConfig
from pallas_kernels.fused_ffn.reference import ACTIVATIONS

# Each target's logical axes (input, output), for tensor parallelism (parallel.sharding):
# split as the projection it adds to is.
TARGET_AXES = {
    "q_proj": ("embed", "q_heads_x_dim"),
    "k_proj": ("embed", "q_heads_x_dim"),
    "v_proj": ("embed", "q_heads_x_dim"),
    "o_proj": ("q_heads_x_dim", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


def target_shapes(arch: LlamaConfig) -> dict[str, tuple[int, int]]:
    """The modules an adapter may target in this model, with their (input, output) sizes
    (a mixture-of-experts model: the attention's only)."""
    hidden, q, kv = arch.hidden_size, arch.q_size, arch.num_key_value_heads * arch.head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    shapes["o_proj"] = (q, hidden)
    if arch.moe is None:
        inter = arch.intermediate_size
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """The adapter slots: per target, a [L, S, R, I] and b [L, S, R, O]."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]


def allocate(arch: LlamaConfig, num_slots: int, rank: int, dtype, partitioner) -> LoraWeights:
    """Empty slots, placed (and split) by the partitioner."""
    a, b = {}, {}
    layers = arch.num_hidden_layers
    for target, (inputs, outputs) in target_shapes(arch).items():
        in_axis, out_axis = TARGET_AXES[target]
        a[target] = partitioner.zeros(
            (layers, num_slots, rank, inputs), dtype, ("layers", None, None, in_axis)
        )
        b[target] = partitioner.zeros(
            (layers, num_slots, rank, outputs), dtype, ("layers", None, None, out_axis)
        )
    return LoraWeights(a, b)


def slot_contents(
    pairs: dict[str, tuple[np.ndarray, np.ndarray]], shapes: dict, layers: int, rank: int, dtype
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """An adapter's pairs as one slot holds them (jaxinfer.model_loader.peft_adapter's
    [L, r, I] and [L, r, O]): every target, zero-padded to rank R, in dtype."""
    out = {}
    for target, (inputs, outputs) in shapes.items():
        a = np.zeros((layers, rank, inputs), dtype)
        b = np.zeros((layers, rank, outputs), dtype)
        if target in pairs:
            pa, pb = pairs[target]
            a[:, : pa.shape[1]], b[:, : pb.shape[1]] = pa, pb
        out[target] = (a, b)
    return out


def write_slot(
    weights: LoraWeights, slot: jax.Array, contents: dict[str, tuple[jax.Array, jax.Array]]
) -> LoraWeights:
    """Slot `slot` (i32[]) holding `contents` (slot_contents'): jitted, with the slots donated."""
    a = {t: weights.a[t].at[:, slot].set(contents[t][0]) for t in weights.a}
    b = {t: weights.b[t].at[:, slot].set(contents[t][1]) for t in weights.b}
    return LoraWeights(a, b)


def delta(lora: LoraWeights, target: str, x, slots, layer, kernel) -> jax.Array:  # [T, O]
    """Each row of x [T, I] times its slot's pair of `target`, in layer `layer`."""
    return kernel(x, lora.a[target], lora.b[target], slots, layer=layer)


def qkv_delta(lora: LoraWeights, x, slots, layer, kernel, arch: LlamaConfig) -> jax.Array:
    """The q, k and v products as the fused QKV projection lays them out: [T, K, G + 2, D]."""
    tokens, heads, dim = x.shape[0], arch.num_key_value_heads, arch.head_dim
    q = delta(lora, "q_proj", x, slots, layer, kernel).reshape(tokens, heads, -1, dim)
    k = delta(lora, "k_proj", x, slots, layer, kernel).reshape(tokens, heads, 1, dim)
    v = delta(lora, "v_proj", x, slots, layer, kernel).reshape(tokens, heads, 1, dim)
    return jnp.concatenate([q, k, v], axis=2)


def lora_ffn(x, gate_up, down, kernels, activation, lora, slots, layer) -> jax.Array:
    """The gated FFN (jaxinfer.layers.linear.gated_ffn_projected) with each row's adapter:
    gate and up [T, 2, I] and down [T, E] each plus its LoRA product."""
    kernel = kernels.lora
    h = gate_up.project(x, kernels)  # [T, 2, I]
    gate = delta(lora, "gate_proj", x, slots, layer, kernel)
    up = delta(lora, "up_proj", x, slots, layer, kernel)
    h = h + jnp.stack([gate, up], axis=1).astype(h.dtype)
    act = ACTIVATIONS[activation](h[:, 0]) * h[:, 1]  # [T, I]
    return down.project(act, kernels) + delta(lora, "down_proj", act, slots, layer, kernel)
