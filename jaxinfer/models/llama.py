"""Llama-family decoder in Flax NNX over a flattened, ragged batch and a paged KV cache.

T: tokens, R: requests, E: hidden size, I: intermediate size, H: query heads, K: kv heads,
D: head dim, V: vocabulary, L: layers.

The decoder layers' parameters are stacked along a leading [L] axis and run under
`jax.lax.scan`, so compile time does not grow with depth. The KV cache (jaxinfer.layers.kv_cache:
values [L, 2, num_blocks, block_size, K, D] and, quantized, their scales) is threaded through
the scan carry and updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.layers import invariant
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.kv_cache import KVCache
from jaxinfer.layers.linear import IN_OUT, OUT_IN, dense_ffn, lm_logits
from jaxinfer.layers.lora import LoraWeights, lora_ffn, qkv_delta
from jaxinfer.layers.lora import delta as lora_delta
from jaxinfer.layers.moe.experts import (
    moe_ffn,
)
from jaxinfer.layers.quantization import Quantization
from jaxinfer.layers.rotary import apply_rotary, cos_sin_cache
from jaxinfer.layers.weights import dense, is_weight
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.params import (
    PARAM_AXES,
    as_weights,
    head_name,
    quantize_weights,
    to_layout,
    weight_axes,
    with_q4_blocks,
)
from jaxinfer.parallel.sharding import Partitioner

REFERENCE_KERNELS = ModelKernels()


class LlamaForCausalLM(nnx.Module):
    """The model: its parameters (a tree of arrays and jaxinfer.layers.weights, placed) as
    nnx.Params, and the forward pass over them."""

    def __init__(self, config: LlamaConfig, params: dict):
        self.config = config
        for name, value in params.items():
            if isinstance(value, dict):  # the layers (DeepSeek-V4's hc_head)
                setattr(self, name, _Params(value))
            elif name in ("rope_cache", "rope_cache_local"):
                # Static (not a Param): rebuilt from the config, never loaded.
                setattr(self, name, nnx.Variable(value))  # f32[max_positions, 2, D / 2]
            else:
                setattr(self, name, nnx.Param(value))

    def __call__(
        self,
        kv_cache: KVCache,  # [L, 2, NB, BS, K, D] values (and scales)
        batch: BatchInputs,
        *,
        kernels: ModelKernels = REFERENCE_KERNELS,
        partitioner: Partitioner | None = None,
        lora: LoraWeights | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # (kv_cache, logits f32[R, V])
        """The whole step in one program: the layers run under `lax.scan`. `lora`: the
        adapter slots the tokens' batch.lora_slots name (jaxinfer.layers.lora)."""
        kv_cache, hidden = self.hidden_states(
            kv_cache, batch, kernels=kernels, partitioner=partitioner, lora=lora
        )
        params = nnx.to_pure_dict(nnx.state(self))
        logits = compute_logits(self.config, params, hidden, batch, kernels, partitioner)
        return kv_cache, logits

    def hidden_states(
        self,
        kv_cache: KVCache,  # [L, 2, NB, BS, K, D] values (and scales)
        batch: BatchInputs,
        *,
        kernels: ModelKernels = REFERENCE_KERNELS,
        partitioner: Partitioner | None = None,
        lora: LoraWeights | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # (kv_cache, hidden [T, E] before the final norm)
        kv_cache, hidden, _ = self._layers(kv_cache, batch, kernels, partitioner, False, lora)
        return kv_cache, hidden

    def residual_streams(
        self,
        kv_cache: KVCache,  # [L, 2, NB, BS, K, D] values (and scales)
        batch: BatchInputs,
        *,
        kernels: ModelKernels = REFERENCE_KERNELS,
        partitioner: Partitioner | None = None,
        lora: LoraWeights | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # (kv_cache, [L, T, E])
        """The residual stream after each layer (Hugging Face's hidden_states[1:], but for
        the last, which HF gives after the final norm): for layer-by-layer parity."""
        kv_cache, _, streams = self._layers(kv_cache, batch, kernels, partitioner, True, lora)
        return kv_cache, streams

    def _layers(self, kv_cache, batch, kernels, partitioner, collect: bool, lora=None):
        params = nnx.to_pure_dict(nnx.state(self))
        kernels = kernels.for_tokens(batch.query_start_loc[-1])  # the padding: after the last
        hidden, residual, cos_sin = embed_tokens(self.config, params, batch)
        layers = params["layers"]
        # A matmul kernel reads each layer's projections out of the stacked [L, ...] weights
        # in place; XLA's ops take the scan's slices.
        in_place = kernels.matmul is not None and kernels.weight_layout == OUT_IN

        def layer_step(carry, layer_params):
            hidden, residual, kv_cache, layer = carry
            if in_place:
                layer_params = {
                    name: w.in_place(layer) if is_weight(w) else w[layer]
                    for name, w in layers.items()
                }
            hidden, residual, kv_cache = decoder_layer(
                self.config,
                layer_params,
                hidden,
                residual,
                kv_cache,
                layer,
                batch,
                cos_sin,
                kernels=kernels,
                partitioner=partitioner,
                lora=lora,
            )
            return (hidden, residual, kv_cache, layer + 1), hidden + residual if collect else None

        (hidden, residual, kv_cache, _), streams = jax.lax.scan(
            layer_step,
            (hidden, residual, kv_cache, jnp.int32(0)),
            None if in_place else layers,
            length=self.config.num_hidden_layers,
        )
        return kv_cache, hidden + residual, streams


class _Params(nnx.Module):
    def __init__(self, params: dict):
        for name, value in params.items():
            setattr(self, name, _Params(value) if isinstance(value, dict) else nnx.Param(value))


def embed_tokens(
    config: LlamaConfig, params: dict, batch: BatchInputs
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(hidden [T, E], residual [T, E] zeros, cos_sin) of the step's tokens: the residual
    stream before the first layer is hidden + residual; cos_sin f32[T, 2, D / 2], or with a
    RoPE of the sliding layers' own f32[2, T, 2, D / 2] (the global layers', the local's)."""
    dtype = params["norm"].dtype
    hidden = params["embed"].rows(batch.token_ids, dtype)
    if config.embedding_scale is not None:
        hidden = hidden * jnp.asarray(config.embedding_scale, dtype)
    cos_sin = params["rope_cache"][batch.positions]
    if "rope_cache_local" in params:
        cos_sin = jnp.stack([cos_sin, params["rope_cache_local"][batch.positions]])
    return hidden, jnp.zeros_like(hidden), cos_sin


def decoder_layer(
    config: LlamaConfig,
    p: dict,  # one layer's parameters (no [L] axis)
    hidden: jax.Array,  # [T, E], the previous sublayer's output
    residual: jax.Array,  # [T, E], the residual stream before it
    kv_cache: KVCache,  # [L, 2, NB, BS, K, D] values (and scales)
    layer: jax.Array,  # i32[], this layer's index in the cache
    batch: BatchInputs,
    cos_sin: jax.Array,  # f32[T, 2, D / 2], or [2, T, 2, D / 2] (embed_tokens)
    *,
    kernels: ModelKernels,
    partitioner: Partitioner | None = None,
    lora: LoraWeights | None = None,  # the adapter slots, stacked over the layers
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (hidden [T, E], residual [T, E], kv_cache)
    """One layer. Each residual add is fused with the norm that follows it. With `lora`,
    each token's adapter (batch.lora_slots) adds its products to the projections."""
    cfg = config
    num_tokens = hidden.shape[0]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    # a model whose layers differ (Gemma 3's local and global): this layer's kind
    sliding = None if cfg.sliding_layers is None else jnp.asarray(cfg.sliding_layers)[layer]
    if cfg.rope_local_theta is not None:
        cos_sin = jnp.where(sliding, cos_sin[1], cos_sin[0])

    def constrain(x, axes):
        return x if partitioner is None else partitioner.constrain(x, axes)

    with jax.named_scope("attention"):
        x, residual = kernels.add_rms_norm(hidden, residual, p["input_norm"], eps=cfg.rms_norm_eps)
        qkv = dense(x, p["qkv_proj"], kernels)  # [T, K, G+2, D]
        if lora is not None:
            qkv = qkv + qkv_delta(lora, x, batch.lora_slots, layer, kernels.lora, cfg)
        if "qkv_bias" in p:
            qkv = qkv + p["qkv_bias"]
        qkv = constrain(qkv, ("tokens", "kv_heads", "qkv", "head_dim"))
        if cfg.clip_qkv is not None:
            qkv = jnp.clip(qkv, -cfg.clip_qkv, cfg.clip_qkv)
        q = qkv[:, :, :group].reshape(num_tokens, -1, cfg.head_dim)  # [T, H, D]
        k = qkv[:, :, group]  # [T, K, D]
        v = qkv[:, :, group + 1]  # [T, K, D]
        if cfg.qk_norm is not None:
            q = _qk_norm(q, p["q_norm"], cfg)
            k = _qk_norm(k, p["k_norm"], cfg)
        q = constrain(apply_rotary(q, cos_sin), ("tokens", "q_heads", "head_dim"))
        k = apply_rotary(k, cos_sin)
        kv_cache = kv_cache.write(layer, k, v, batch.slot_mapping)
        queries = kv_cache.queries(q, layer)

        def attention(window):
            return kernels.attention(
                queries,
                kv_cache.values,
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
                batch.num_seqs,
                sm_scale=cfg.sm_scale,
                sliding_window=window,
                layer=layer,
                **kv_cache.attention_kwargs(),
            )  # [T, H, D]

        if sliding is None:
            attn = attention(cfg.sliding_window)
        else:  # one kernel call runs: the window's or the whole context's
            attn = jax.lax.cond(
                sliding, lambda: attention(cfg.sliding_window), lambda: attention(None)
            )
        attn = constrain(attn, ("tokens", "q_heads", "head_dim"))
        attn = attn.reshape(num_tokens, -1)  # [T, H * D]
        hidden = dense(attn, p["o_proj"], kernels)
        if lora is not None:
            hidden = hidden + lora_delta(
                lora, "o_proj", attn, batch.lora_slots, layer, kernels.lora
            )
        if cfg.sandwich_norms:
            hidden = kernels.rms_norm(hidden, p["attention_output_norm"], cfg.rms_norm_eps)
        hidden = constrain(hidden, ("tokens", "embed"))
    with jax.named_scope("mlp"):
        x, residual = kernels.add_rms_norm(
            hidden, residual, p["post_attention_norm"], eps=cfg.rms_norm_eps
        )
        if cfg.moe is not None:
            hidden = moe_ffn(cfg, p, x, kernels, partitioner)
        elif lora is not None:
            gate_up, down, slots = p["gate_up_proj"], p["down_proj"], batch.lora_slots
            hidden = lora_ffn(x, gate_up, down, kernels, cfg.hidden_act, lora, slots, layer)
        else:
            hidden = dense_ffn(x, p["gate_up_proj"], p["down_proj"], kernels, cfg.hidden_act)
        if cfg.sandwich_norms:
            hidden = kernels.rms_norm(hidden, p["ffn_output_norm"], cfg.rms_norm_eps)
        hidden = constrain(hidden, ("tokens", "embed"))
    return hidden, residual, kv_cache


def _qk_norm(x: jax.Array, weight: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """RMSNorm of q [T, H, D] or k [T, K, D] over each head (weight [D]) or over all of its
    heads together (weight [H * D] / [K * D]), in float32 as Hugging Face's, its mean of
    squares a fixed tree (a row's result independent of the other rows: batch_invariant)."""
    shape = x.shape
    if cfg.qk_norm == "all":
        x = x.reshape(shape[0], -1)
    return invariant.rms_norm(x, weight, cfg.rms_norm_eps).reshape(shape)


def compute_logits(
    config: LlamaConfig,
    params: dict,
    hidden: jax.Array,
    batch: BatchInputs,
    kernels: ModelKernels = REFERENCE_KERNELS,
    partitioner: Partitioner | None = None,
) -> jax.Array:  # f32[R, V]
    """Final norm and LM head on the rows that sample only (one per request; the padding rows
    past batch.num_samples skipped by the kernels that can, ModelKernels.for_tokens)."""
    rows = hidden[batch.logits_indices]
    if batch.num_samples is not None:
        kernels = kernels.for_tokens(batch.num_samples[0])
    return lm_head(config, params, rows, kernels, partitioner)


def lm_head(
    config: LlamaConfig,
    params: dict,
    hidden: jax.Array,
    kernels: ModelKernels = REFERENCE_KERNELS,
    partitioner: Partitioner | None = None,
) -> jax.Array:  # f32[N, V], whole on every device (the sampler needs every logit)
    """Final norm (through the norm kernel) and LM head (through the matmul kernel of an
    "out_in" head, see ModelKernels) of some hidden rows [N, E]."""
    with jax.named_scope("lm_head"):
        x = kernels.rms_norm(hidden, params["norm"], config.rms_norm_eps)
        head = params[head_name(config)]
        logits = lm_logits(x, head, config.tie_word_embeddings, kernels)
        logits = logits.astype(jnp.float32)
        if partitioner is not None:
            logits = partitioner.constrain(logits, (None, None))
        return logits


def build_llama(
    config: LlamaConfig,
    params: dict,
    dtype,
    partitioner: Partitioner | None = None,
    weight_layout: str = IN_OUT,
    quantization: Quantization | str | None = None,
    int4_blocks: dict | None = None,
    model_class: type[LlamaForCausalLM] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Split graph and state of a model whose parameters are `params` (the loader's tree: host
    arrays, or arrays already placed), its projections as weights of their format (quantized
    as `quantization` says; jaxinfer.layers.weights), put in `weight_layout` and each array placed on
    the partitioner's mesh by its logical axes (every device receives only its shards), or on
    the default device. int4_blocks: a GGUF file's 4-bit blocks to take as the int4 weights
    themselves (jaxinfer.model_loader.gguf_blocks.load_gguf_blocks' tree, with_q4_blocks).
    Weights the loader gives in another format already (a GGUF file's blocks) stay so.
    model_class: the module (a hybrid's, jaxinfer.models.causal_lm); None: Llama's."""
    values = as_weights(config, {k: v for k, v in params.items() if not k.startswith("rope_")})
    if quantization is not None:
        values = quantize_weights(config, values, quantization)
    if int4_blocks:
        values = with_q4_blocks(values, int4_blocks)
    axes = weight_axes(values)
    values, axes = to_layout(values, weight_layout), to_layout(axes, weight_layout)
    if config.compressed is not None:  # (DeepSeek-V4 turns its RoPE from the positions)
        return _split(config, values, axes, partitioner, model_class)
    values["rope_cache"] = cos_sin_cache(
        config.max_position_embeddings, config.rotary_dim, config.rope_theta, config.rope_scaling
    )
    axes["rope_cache"] = PARAM_AXES["rope_cache"]
    if config.rope_local_theta is not None:  # the sliding layers' (unscaled)
        values["rope_cache_local"] = cos_sin_cache(
            config.max_position_embeddings, config.head_dim, config.rope_local_theta, None
        )
        axes["rope_cache_local"] = PARAM_AXES["rope_cache"]
    return _split(config, values, axes, partitioner, model_class)


def _split(config, values, axes, partitioner, model_class) -> tuple[nnx.GraphDef, nnx.State]:
    if partitioner is None:
        placed = jax.tree.map(jnp.asarray, values)
    else:
        placed = jax.tree.map(partitioner.place, values, axes)
    return nnx.split((model_class or LlamaForCausalLM)(config, placed))
