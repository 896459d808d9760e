"""Llama-family decoder in Flax NNX over a flattened, ragged batch and a paged KV cache.

T: tokens, R: requests, E: hidden size, I: intermediate size, H: query heads, K: kv heads,
D: head dim, V: vocabulary, L: layers.

The decoder layers' parameters are stacked along a leading [L] axis and run under
`jax.lax.scan`, so compile time does not grow with depth. The KV cache
[L, 2, num_blocks, block_size, K, D] is threaded through the scan carry and updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.engine.batch import BatchInputs
from jaxinfer.layers.gguf_weights import AXES as GGUF_AXES
from jaxinfer.layers.gguf_weights import blocks_of, is_block_param
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.linear import (
    IN_OUT,
    LAYER_PERMUTATIONS,
    OUT_IN,
    StackedWeight,
    axes_in_layout,
    dense,
    gated_ffn_out_in,
    lm_logits,
    to_layout,
)
from jaxinfer.layers.quantization import (
    SCALE,
    SCALE_AXES,
    check_quantization,
    dequantize,
    dequantize_rows,
    quantize_params,
)
from jaxinfer.layers.rotary import apply_rotary, cos_sin_cache
from jaxinfer.models.llama_config import LlamaConfig
from jaxinfer.parallel.sharding import Partitioner
from pallas_kernels.add_rms_norm.reference import rms_norm
from pallas_kernels.ragged_paged_attention.reference import write_kv_reference

REFERENCE_KERNELS = ModelKernels()

# Each parameter's logical axes (jaxinfer.parallel.sharding maps them onto the mesh).
# QKV is fused grouped by KV head, [.., K, G + 2, D] with G = H / K query heads then the key
# and the value, so splitting K keeps each head's Q, K and V on one device.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "norm": ("embed",),
    "rope_cache": (None, None, None),
    "layers": {
        "input_norm": ("layers", "embed"),
        "post_attention_norm": ("layers", "embed"),
        "qkv_proj": ("layers", "embed", "kv_heads", "qkv", "head_dim"),
        "qkv_bias": ("layers", "kv_heads", "qkv", "head_dim"),
        "o_proj": ("layers", "q_heads_x_dim", "embed"),
        "gate_up_proj": ("layers", "embed", "gate_up", "mlp"),
        "down_proj": ("layers", "mlp", "embed"),
        **SCALE_AXES["layers"],
        **GGUF_AXES["layers"],
    },
    "embed_scale": SCALE_AXES["embed_scale"],
    "lm_head_scale": SCALE_AXES["lm_head_scale"],
    **{name: axes for name, axes in GGUF_AXES.items() if name != "layers"},
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, scale: float = 0.02) -> nnx.Param:
    return nnx.Param((scale * jax.random.normal(rngs.params(), shape)).astype(dtype))


def _int8_param(shape: tuple[int, ...]) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.int8))


def _scale_param(shape: tuple[int, ...]) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32))


def _declare(module: nnx.Module, arrays: dict) -> None:
    """Parameters shaped like `arrays` (name -> array), set on `module` (zeros until loaded)."""
    for name, array in arrays.items():
        setattr(module, name, nnx.Param(jnp.zeros(array.shape, array.dtype)))


class DecoderLayers(nnx.Module):
    """All L decoder layers; every parameter has a leading [L] axis. With int8 quantization
    each projection is int8 with a float32 scale per output channel (`<name>_scale`)."""

    def __init__(
        self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs, quantization=None, gguf_blocks=None
    ):
        num_layers, hidden = config.num_hidden_layers, config.hidden_size
        kv_heads, head_dim = config.num_key_value_heads, config.head_dim
        qkv_shape = (kv_heads, config.num_attention_heads // kv_heads + 2, head_dim)
        inter = config.intermediate_size
        self.input_norm = nnx.Param(jnp.ones((num_layers, hidden), dtype))
        self.post_attention_norm = nnx.Param(jnp.ones((num_layers, hidden), dtype))
        if config.attention_bias:
            self.qkv_bias = _param(rngs, (num_layers, *qkv_shape), dtype)  # [L, K, G+2, D]
        shapes = {  # (input axis size, output shape)
            "qkv_proj": (hidden, qkv_shape),  # [L, E, K, G+2, D]
            "o_proj": (config.q_size, (hidden,)),  # [L, H*D, E]
            "gate_up_proj": (hidden, (2, inter)),  # [L, E, 2, I]
            "down_proj": (inter, (hidden,)),  # [L, I, E]
        }
        for name, (size_in, out) in shapes.items():
            if quantization is None:
                setattr(self, name, _param(rngs, (num_layers, size_in, *out), dtype))
            else:
                setattr(self, name, _int8_param((num_layers, size_in, *out)))
                setattr(self, name + SCALE, _scale_param((num_layers, *out)))
        _declare(self, gguf_blocks or {})


class LlamaForCausalLM(nnx.Module):
    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
        quantization: str | None = None,
        gguf_blocks: dict | None = None,
    ):
        """quantization "int8": projections and the LM head (the embedding when tied) are
        int8 with per-output-channel scales (jaxinfer.layers.quantization). gguf_blocks: the
        GGUF blocks kept beside some weights (jaxinfer.layers.gguf_weights; the tree of
        arrays the parameters are shaped like)."""
        self.config = config
        vocab, hidden = config.vocab_size, config.hidden_size
        tied = config.tie_word_embeddings
        if quantization is not None and tied:
            self.embed = _int8_param((vocab, hidden))  # [V, E]
            self.embed_scale = _scale_param((vocab,))
        else:
            self.embed = _param(rngs, (vocab, hidden), dtype)  # [V, E]
        blocks = dict(gguf_blocks or {})
        self.layers = DecoderLayers(
            config,
            dtype=dtype,
            rngs=rngs,
            quantization=quantization,
            gguf_blocks=blocks.pop("layers", None),
        )
        _declare(self, blocks)
        self.norm = nnx.Param(jnp.ones((hidden,), dtype))
        if not tied and quantization is not None:
            self.lm_head = _int8_param((hidden, vocab))  # [E, V]
            self.lm_head_scale = _scale_param((vocab,))
        elif not tied:
            self.lm_head = _param(rngs, (hidden, vocab), dtype)  # [E, V]
        # Static (not a Param): rebuilt from the config, never loaded or sharded.
        self.rope_cache = nnx.Variable(
            jnp.asarray(
                cos_sin_cache(
                    config.max_position_embeddings,
                    config.head_dim,
                    config.rope_theta,
                    config.rope_scaling,
                )
            )
        )  # f32[max_positions, 2, D / 2]

    def __call__(
        self,
        kv_cache: jax.Array,  # [L, 2, NB, BS, K, D]
        batch: BatchInputs,
        *,
        kernels: ModelKernels = REFERENCE_KERNELS,
        partitioner: Partitioner | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # (kv_cache, logits f32[R, V])
        """The whole step in one program: the layers run under `lax.scan`."""
        kv_cache, hidden = self.hidden_states(
            kv_cache, batch, kernels=kernels, partitioner=partitioner
        )
        params = nnx.to_pure_dict(nnx.state(self))
        logits = compute_logits(
            self.config,
            params,
            hidden,
            batch,
            partitioner,
            kernels.weight_layout,
            kernels.matmul,
        )
        return kv_cache, logits

    def hidden_states(
        self,
        kv_cache: jax.Array,  # [L, 2, NB, BS, K, D]
        batch: BatchInputs,
        *,
        kernels: ModelKernels = REFERENCE_KERNELS,
        partitioner: Partitioner | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # (kv_cache, hidden [T, E] before the final norm)
        params = nnx.to_pure_dict(nnx.state(self))
        hidden, residual, cos_sin = embed_tokens(params, batch)
        layers = params["layers"]
        # A matmul kernel reads each layer's projections out of the stacked [L, ...] weights
        # in place; XLA's ops take the scan's slices.
        in_place = kernels.matmul is not None and kernels.weight_layout == OUT_IN

        def layer_step(carry, layer_params):
            hidden, residual, kv_cache, layer = carry
            if in_place:
                layer_params = {
                    name: StackedWeight(a, layer)
                    if name in LAYER_PERMUTATIONS or is_block_param(name)
                    else a[layer]
                    for name, a in layers.items()
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
            )
            return (hidden, residual, kv_cache, layer + 1), None

        (hidden, residual, kv_cache, _), _ = jax.lax.scan(
            layer_step,
            (hidden, residual, kv_cache, jnp.int32(0)),
            None if in_place else layers,
            length=self.config.num_hidden_layers,
        )
        return kv_cache, hidden + residual


def embed_tokens(params: dict, batch: BatchInputs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(hidden [T, E], residual [T, E] zeros, cos_sin f32[T, 2, D / 2]) of the step's tokens:
    the residual stream before the first layer is hidden + residual."""
    dtype = params["norm"].dtype
    hidden = dequantize_rows(params["embed"], params.get("embed" + SCALE), batch.token_ids, dtype)
    return hidden, jnp.zeros_like(hidden), params["rope_cache"][batch.positions]


def decoder_layer(
    config: LlamaConfig,
    p: dict,  # one layer's parameters (no [L] axis)
    hidden: jax.Array,  # [T, E], the previous sublayer's output
    residual: jax.Array,  # [T, E], the residual stream before it
    kv_cache: jax.Array,  # [L, 2, NB, BS, K, D]
    layer: jax.Array,  # i32[], this layer's index in the cache
    batch: BatchInputs,
    cos_sin: jax.Array,  # f32[T, 2, D / 2]
    *,
    kernels: ModelKernels,
    partitioner: Partitioner | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (hidden [T, E], residual [T, E], kv_cache)
    """One layer. Each residual add is fused with the norm that follows it."""
    cfg = config
    num_tokens = hidden.shape[0]
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def constrain(x, axes):
        return x if partitioner is None else partitioner.constrain(x, axes)

    with jax.named_scope("attention"):
        x, residual = kernels.add_rms_norm(hidden, residual, p["input_norm"], eps=cfg.rms_norm_eps)
        layout = kernels.weight_layout
        matmul = kernels.matmul
        qkv = dense(
            x, p["qkv_proj"], layout, p.get("qkv_proj" + SCALE), matmul, blocks_of(p, "qkv_proj")
        )  # [T, K, G+2, D]
        if "qkv_bias" in p:
            qkv = qkv + p["qkv_bias"]
        qkv = constrain(qkv, ("tokens", "kv_heads", "qkv", "head_dim"))
        q = qkv[:, :, :group].reshape(num_tokens, -1, cfg.head_dim)  # [T, H, D]
        q = constrain(apply_rotary(q, cos_sin), ("tokens", "q_heads", "head_dim"))
        k = apply_rotary(qkv[:, :, group], cos_sin)  # [T, K, D]
        v = qkv[:, :, group + 1]  # [T, K, D]
        kv_cache = write_kv_reference(kv_cache, layer, k, v, batch.slot_mapping)
        attn = kernels.attention(
            q,
            kv_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.num_seqs,
            sm_scale=cfg.head_dim**-0.5,
            layer=layer,
        )  # [T, H, D]
        attn = constrain(attn, ("tokens", "q_heads", "head_dim"))
        hidden = dense(
            attn.reshape(num_tokens, -1),
            p["o_proj"],
            layout,
            p.get("o_proj" + SCALE),
            matmul,
            blocks_of(p, "o_proj"),
        )
        hidden = constrain(hidden, ("tokens", "embed"))
    with jax.named_scope("mlp"):
        x, residual = kernels.add_rms_norm(
            hidden, residual, p["post_attention_norm"], eps=cfg.rms_norm_eps
        )
        gate_up_scale, down_scale = p.get("gate_up_proj" + SCALE), p.get("down_proj" + SCALE)
        if layout == IN_OUT:  # the kernel takes float weights
            gate_up = dequantize(p["gate_up_proj"], gate_up_scale, x.dtype)
            hidden = kernels.ffn(x, gate_up, dequantize(p["down_proj"], down_scale, x.dtype))
        else:
            hidden = gated_ffn_out_in(
                x,
                p["gate_up_proj"],
                p["down_proj"],
                gate_up_scale,
                down_scale,
                matmul,
                blocks_of(p, "gate_up_proj"),
                blocks_of(p, "down_proj"),
            )
        hidden = constrain(hidden, ("tokens", "embed"))
    return hidden, residual, kv_cache


def compute_logits(
    config: LlamaConfig,
    params: dict,
    hidden: jax.Array,
    batch: BatchInputs,
    partitioner: Partitioner | None = None,
    weight_layout: str = IN_OUT,
    matmul: Callable | None = None,
) -> jax.Array:  # f32[R, V]
    """Final norm and LM head on the rows that sample only (one per request)."""
    rows = hidden[batch.logits_indices]
    return lm_head(config, params, rows, partitioner, weight_layout, matmul)


def lm_head(
    config: LlamaConfig,
    params: dict,
    hidden: jax.Array,
    partitioner: Partitioner | None = None,
    weight_layout: str = IN_OUT,
    matmul: Callable | None = None,
) -> jax.Array:  # f32[N, V], whole on every device (the sampler needs every logit)
    """Final norm and LM head of some hidden rows [N, E] (`matmul`: the kernel that computes
    an "out_in" head, see ModelKernels)."""
    with jax.named_scope("lm_head"):
        x = rms_norm(hidden, params["norm"], config.rms_norm_eps)
        tied = config.tie_word_embeddings
        name = "embed" if tied else "lm_head"
        scale = params.get(name + SCALE)
        blocks = blocks_of(params, name)
        logits = lm_logits(x, params[name], weight_layout, tied, scale, matmul, blocks)
        logits = logits.astype(jnp.float32)
        if partitioner is not None:
            logits = partitioner.constrain(logits, (None, None))
        return logits


def param_axes(params: dict, axes: dict = PARAM_AXES) -> dict:
    """The logical axes of each array in a parameter tree (from PARAM_AXES)."""
    return {
        name: param_axes(value, axes[name]) if isinstance(value, dict) else axes[name]
        for name, value in params.items()
    }


def build_llama(
    config: LlamaConfig,
    params: dict,
    dtype,
    partitioner: Partitioner | None = None,
    weight_layout: str = IN_OUT,
    quantization: str | None = None,
    gguf_blocks: dict | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Split graph and state of a model whose parameters are `params` (host arrays in the
    loader's layout, or arrays already placed), quantized if asked
    (jaxinfer.layers.quantization), put in `weight_layout` (jaxinfer.layers.linear) and each
    placed on the partitioner's mesh by its logical axes (every device receives only its
    shards), or on the default device. The module's declared shapes are "in_out".
    gguf_blocks: GGUF blocks to keep beside their weights ("out_in" arrays in the tree of
    jaxinfer.layers.gguf_weights.block_tree)."""
    check_quantization(quantization)
    abstract = nnx.eval_shape(
        lambda: LlamaForCausalLM(
            config,
            dtype=dtype,
            rngs=nnx.Rngs(0),
            quantization=quantization,
            gguf_blocks=gguf_blocks,
        )
    )
    graphdef, state = nnx.split(abstract)
    values = dict(params)
    if quantization is not None:
        values = quantize_params(values, config.tie_word_embeddings)
    values = to_layout(values, weight_layout)
    if gguf_blocks:
        blocks = dict(gguf_blocks)
        values["layers"] = {**values["layers"], **blocks.pop("layers", {})}
        values.update(blocks)
    values["rope_cache"] = cos_sin_cache(
        config.max_position_embeddings, config.head_dim, config.rope_theta, config.rope_scaling
    )
    if partitioner is None:
        placed = jax.tree.map(jnp.asarray, values)
    else:
        axes = param_axes(values, axes_in_layout(PARAM_AXES, weight_layout))
        placed = jax.tree.map(partitioner.place, values, axes)
    nnx.replace_by_pure_dict(state, placed)
    return graphdef, state
