"""The hybrid decoder of Qwen3.5 (Qwen3_5ForCausalLM, text) and Qwen3-Next: Gated DeltaNet
layers beside gated full-attention layers, over a flattened ragged batch, the attention
layers' K/V in the paged cache and the linear layers' states in per-request slots
(jaxinfer.layers.state_cache.HybridCache).

Layers follow arch.hybrid.layer_types, a period repeated (three linear_attention, then one
full_attention); the layers run as a scan over the periods, so compile time does not grow
with depth. Besides the Llama decoder: q_proj also gives each head's output gate (the
attention's output times sigmoid(gate)); q and k are normalized per head; RoPE turns only
the first rotary_dim dims of each head. The checkpoints' norms multiply by (1 + w); the loader
adds the 1 (arch.norm_offset), so the norms here multiply by their weights as Llama's do
(the linear layers' gated norm, which multiplies by w, excepted).

Parameters ("in_out", each kind's layers stacked): the Llama decoder's input_norm,
post_attention_norm, gate_up_proj and down_proj over all L layers; "linear" (jaxinfer.layers
.gated_deltanet) over the Ll linear layers; "attention" over the La attention layers:
    q_proj [La, E, H * 2D] (per head: its q, then its gate), k_proj / v_proj [La, E, K * D],
    o_proj [La, H * D, E], q_norm / k_norm [La, D].

T: tokens, E: hidden size, H / K: query / kv heads, D: head dim, L: layers, P: layers a period.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.arch_config import FULL_ATTENTION, LINEAR_ATTENTION, LlamaConfig
from jaxinfer.layers import invariant
from jaxinfer.layers.gated_deltanet import gated_deltanet
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.kv_cache import KVCache
from jaxinfer.layers.linear import OUT_IN, dense_ffn
from jaxinfer.layers.moe.experts import moe_ffn
from jaxinfer.layers.rotary import apply_rotary
from jaxinfer.layers.state_cache import HybridCache, state_batch
from jaxinfer.layers.weights import dense, is_weight
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.llama import LlamaForCausalLM, embed_tokens
from jaxinfer.parallel.sharding import Partitioner


class HybridForCausalLM(LlamaForCausalLM):
    """The Llama model's parameters and LM head; its own layers (HybridCache for the cache)."""

    def _layers(self, cache, batch, kernels, partitioner, collect: bool, lora=None):
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on hybrid models")
        params = nnx.to_pure_dict(nnx.state(self))
        return hybrid_layers(self.config, params, cache, batch, kernels, partitioner, collect)


def hybrid_layers(
    config: LlamaConfig,
    params: dict,
    cache: HybridCache,
    batch: BatchInputs,
    kernels: ModelKernels,
    partitioner: Partitioner | None,
    collect: bool,
) -> tuple[HybridCache, jax.Array, jax.Array | None]:  # (cache, hidden [T, E], [L, T, E])
    """Every layer, as a scan over the periods of layer_types: (the cache, the residual
    stream after the last layer, and with `collect` the stream after each layer)."""
    hybrid = config.hybrid
    period = hybrid.period
    per_linear, per_full = period.count(LINEAR_ATTENTION), period.count(FULL_ATTENTION)
    hidden, residual, cos_sin = embed_tokens(config, params, batch)
    layers = params["layers"]
    # The linear layers' kernels see the step's requests' states only, gathered from their
    # slots (request r's in row r) and scattered back: a step costs its requests' states, not
    # every slot's (request rows and prefix checkpoints).
    rows = jnp.asarray(batch.state_rows)  # i32[R]
    states = state_batch(
        batch.query_start_loc, batch.positions, jnp.arange(rows.shape[0]), batch.num_seqs
    )
    # a matmul kernel reads each layer's projections out of the stacked weights in place
    in_place = kernels.matmul is not None and kernels.weight_layout == OUT_IN

    def take(tree, index):
        def one(x):
            if is_weight(x) and in_place:
                return x.in_place(index)
            return jax.tree.map(lambda a: a[index], x)

        return jax.tree.map(one, tree, is_leaf=is_weight)

    shared = {k: v for k, v in layers.items() if k not in ("linear", "attention")}

    def one_period(carry, index):
        hidden, residual, kv, conv, delta = carry
        streams = []
        for j, kind in enumerate(period):
            layer = index * len(period) + j
            p = take(shared, layer)
            x, residual = kernels.add_rms_norm(
                hidden, residual, p["input_norm"], eps=config.rms_norm_eps
            )
            if kind == LINEAR_ATTENTION:
                i = index * per_linear + period[:j].count(LINEAR_ATTENTION)
                hidden, c, d = gated_deltanet(
                    take(layers["linear"], i), x, conv[i, rows], delta[i, rows], states,
                    hybrid.linear, kernels,
                )  # fmt: skip
                conv, delta = conv.at[i, rows].set(c), delta.at[i, rows].set(d)
            else:
                i = index * per_full + period[:j].count(FULL_ATTENTION)
                p_attn = take(layers["attention"], i)
                hidden, kv = gated_attention(config, p_attn, x, kv, i, batch, cos_sin, kernels)
            x, residual = kernels.add_rms_norm(
                hidden, residual, p["post_attention_norm"], eps=config.rms_norm_eps
            )
            if config.moe is not None:
                hidden = moe_ffn(config, p, x, kernels, partitioner)
            else:
                hidden = dense_ffn(x, p["gate_up_proj"], p["down_proj"], kernels, "silu")
            if collect:
                streams.append(hidden + residual)
        out = jnp.stack(streams) if collect else None
        return (hidden, residual, kv, conv, delta), out

    num_periods = len(hybrid.layer_types) // len(period)
    (hidden, residual, kv, conv, delta), streams = jax.lax.scan(
        one_period,
        (hidden, residual, cache.kv, cache.conv, cache.delta),
        jnp.arange(num_periods, dtype=jnp.int32),
    )
    if collect:
        streams = streams.reshape(-1, *streams.shape[2:])  # [L, T, E]
    return HybridCache(kv, conv, delta), hidden + residual, streams


def gated_attention(
    config: LlamaConfig,
    p: dict,  # one attention layer's parameters
    x: jax.Array,  # [T, E]
    kv_cache: KVCache,  # [La, 2, NB, BS, K, D]
    layer: jax.Array,  # i32[], the layer's index among the attention layers
    batch: BatchInputs,
    cos_sin: jax.Array,  # f32[T, 2, R / 2], R the rotary dims
    kernels: ModelKernels,
) -> tuple[jax.Array, KVCache]:  # ([T, E], kv_cache)
    """The full-attention layer: q with its output gate, q/k norms, partial RoPE, the paged
    cache."""
    tokens, d = x.shape[0], config.head_dim
    rotary = config.hybrid.rotary_dim

    def norm_rotate(x, weight):  # [T, N, D]
        x = invariant.rms_norm(x, weight, config.rms_norm_eps)
        return jnp.concatenate([apply_rotary(x[..., :rotary], cos_sin), x[..., rotary:]], -1)

    qg = dense(x, p["q_proj"], kernels).reshape(tokens, config.num_attention_heads, 2 * d)
    q, gate = norm_rotate(qg[..., :d], p["q_norm"]), qg[..., d:].reshape(tokens, -1)
    k = dense(x, p["k_proj"], kernels).reshape(tokens, config.num_key_value_heads, d)
    k = norm_rotate(k, p["k_norm"])
    v = dense(x, p["v_proj"], kernels).reshape(tokens, config.num_key_value_heads, d)
    kv_cache = kv_cache.write(layer, k, v, batch.slot_mapping)
    attn = kernels.attention(
        kv_cache.queries(q, layer),
        kv_cache.values,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.num_seqs,
        sm_scale=config.sm_scale,
        layer=layer,
        **kv_cache.attention_kwargs(),
    )  # [T, H, D]
    attn = attn.reshape(tokens, -1) * jax.nn.sigmoid(gate)
    return dense(attn, p["o_proj"], kernels), kv_cache
