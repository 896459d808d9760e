"""The model's parameter tree as the loader gives it and the model takes it: each array's
logical axes (sharding), the projections as weights of their format (float, int8, int4, GGUF
blocks; jaxinfer.layers.weights), the two layouts, and random trees for benchmarks.

E: hidden size, I: intermediate size, H: query heads, K: kv heads, D: head dim, V:
vocabulary, L: layers, X: experts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.layers.linear import IN_OUT
from jaxinfer.layers.moe.experts import (
    EXPERT_AXES,
    EXPERT_PROJECTIONS,
    FLOAT_PROJECTIONS,
)
from jaxinfer.layers.quantization import Quantization
from jaxinfer.layers.weights import Dense, Int4, Int4Parts, is_weight

# The loader's parameter tree ("in_out", layers stacked [L, ...]): each array's logical axes
# (jaxinfer.parallel.sharding maps them onto the mesh). QKV is fused grouped by KV head,
# [.., K, G + 2, D] with G = H / K query heads then the key and the value, so splitting K keeps
# each head's Q, K and V on one device.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "norm": ("embed",),
    "rope_cache": (None, None, None),
    "layers": {
        "input_norm": ("layers", "embed"),
        "post_attention_norm": ("layers", "embed"),
        "attention_output_norm": ("layers", "embed"),  # sandwich norms (Gemma)
        "ffn_output_norm": ("layers", "embed"),
        "qkv_proj": ("layers", "embed", "kv_heads", "qkv", "head_dim"),
        "qkv_bias": ("layers", "kv_heads", "qkv", "head_dim"),
        "o_proj": ("layers", "q_heads_x_dim", "embed"),
        "gate_up_proj": ("layers", "embed", "gate_up", "mlp"),
        "down_proj": ("layers", "mlp", "embed"),
        "q_norm": ("layers", None),  # [L, D] per head, or [L, H * D] over all heads
        "k_norm": ("layers", None),  # [L, D], or [L, K * D]
        **{name: ("layers", *axes) for name, axes in EXPERT_AXES.items()},
        # a hybrid model's (jaxinfer.models.qwen3_5): its linear layers' and attention layers'
        "linear": {  # split by key-head groups (jaxinfer.layers.gated_deltanet)
            "in_proj_qkv": ("layers", "embed", "linear_heads"),
            "in_proj_z": ("layers", "embed", "linear_heads"),
            "in_proj_b": ("layers", "embed", "linear_heads"),
            "in_proj_a": ("layers", "embed", "linear_heads"),
            "conv1d": ("layers", "linear_heads", None),
            "dt_bias": ("layers", "linear_heads"),
            "A_log": ("layers", "linear_heads"),
            "norm": ("layers", None),
            "out_proj": ("layers", "linear_heads", "embed"),
        },
        "attention": {  # split by heads (each query head's q and gate side by side)
            "q_proj": ("layers", "embed", "q_heads_x_dim"),
            "k_proj": ("layers", "embed", "kv_heads_x_dim"),
            "v_proj": ("layers", "embed", "kv_heads_x_dim"),
            "o_proj": ("layers", "q_heads_x_dim", "embed"),
            "q_norm": ("layers", None),
            "k_norm": ("layers", None),
        },
        # DeepSeek-V4's (jaxinfer.model_loader.deepseek_v4_weights): its query heads split
        # (their projection's columns, their sinks, their groups' output projections), its
        # one K=V head, compressors and indexer whole on every device (its experts, shared
        # expert and vocabulary split as the others')
        **{name: ("layers", None) for name in ("q_a_norm", "kv_norm")},
        "sinks": ("layers", "q_heads"),
        **{name: ("layers", None, None) for name in ("q_a_proj", "kv_proj")},
        "q_b_proj": ("layers", None, "q_heads_x_dim"),
        "o_a_proj": ("layers", "head_groups", None, None),
        "o_b_proj": ("layers", "head_groups", "embed"),
        **{
            hc: {"fn": ("layers", None, None), "base": ("layers", None), "scale": ("layers", None)}
            for hc in ("attn_hc", "ffn_hc")
        },
        "hash": {"tid2eid": ("layers", None, None)},
        "hca": {
            **{name: ("layers", "embed", None) for name in ("kv_proj", "gate_proj")},
            "position_bias": ("layers", None, None),
            "kv_norm": ("layers", None),
        },
        "csa": {
            **{
                name: ("layers", "embed", None)
                for name in (
                    "kv_proj",
                    "gate_proj",
                    "index_kv_proj",
                    "index_gate_proj",
                    "index_weights_proj",
                )
            },
            **{
                name: ("layers", None, None)
                for name in ("position_bias", "index_position_bias", "index_q_b_proj")
            },
            **{name: ("layers", None) for name in ("kv_norm", "index_kv_norm")},
        },
    },
    "hc_head": {"fn": (None, None), "base": (None,), "scale": (None,)},
}


# The projections of a decoder layer, each with its input (contracted) axis in the loader's
# "in_out" layout, counted from the end: [L, E, K, G + 2, D], [L, H * D, E], [L, E, 2, I],
# [L, I, E]; the experts' (jaxinfer.layers.moe.experts) [L, X, E, 2, I], [L, X, I, E].
LAYER_PROJECTIONS = {
    "qkv_proj": -4,
    "o_proj": -2,
    "gate_up_proj": -3,
    "down_proj": -2,
    **EXPERT_PROJECTIONS,
}
# A hybrid model's projections ([Ll or La, in, out]): every one contracts its axis -2.
HYBRID_PROJECTIONS = (
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "q_proj", "k_proj", "v_proj", "o_proj",
)  # fmt: skip


def as_weights(config: LlamaConfig, params: dict) -> dict:
    """The loader's tree with every projection (a MoE router too; the LM head; the embedding,
    which is the head when tied) as a jaxinfer.layers.weights.Dense, or an Int4 where a
    quantized checkpoint holds it so (Int4Parts)."""
    out = dict(params)
    projections = {**LAYER_PROJECTIONS, **FLOAT_PROJECTIONS}

    def weight(a, input_axis: int):
        if is_weight(a):  # read in another form (a GGUF file's blocks)
            return a
        return a.weight(input_axis) if isinstance(a, Int4Parts) else Dense(a, input_axis)

    out["layers"] = {
        name: weight(a, projections[name]) if name in projections else a
        for name, a in params["layers"].items()
    }
    for kind in ("linear", "attention"):  # a hybrid model's
        if kind in out["layers"]:
            out["layers"][kind] = {
                name: weight(a, -2) if name in HYBRID_PROJECTIONS else a
                for name, a in out["layers"][kind].items()
            }
    out["embed"] = weight(params["embed"], -1)  # [V, E]
    if not config.tie_word_embeddings:
        out["lm_head"] = weight(params["lm_head"], -2)  # [E, V]
    return out


def weight_axes(tree: dict, axes: dict = PARAM_AXES) -> dict:
    """The logical axes of each array of a parameter tree in the "in_out" layout (the same
    tree, each array replaced by its axes, each weight by its format's axes)."""
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out[name] = weight_axes(value, axes[name])
        elif is_weight(value):
            out[name] = value.axes(axes[name])
        else:
            out[name] = axes[name]
    return out


def head_name(config: LlamaConfig) -> str:
    return "embed" if config.tie_word_embeddings else "lm_head"


def _map_weights(fn, tree: dict) -> dict:
    """fn applied to every weight of a tree (of arrays or of axes)."""
    return jax.tree.map(lambda x: fn(x) if is_weight(x) else x, tree, is_leaf=is_weight)


def to_layout(tree: dict, layout: str) -> dict:
    """A tree of "in_out" weights (or of their axes) in `layout` (jaxinfer.layers.linear)."""
    return tree if layout == IN_OUT else _map_weights(lambda w: w.to_out_in(), tree)


def quantize_weights(
    config: LlamaConfig, tree: dict, quantization: Quantization | str = "int8"
) -> dict:
    """Every projection in the format of `quantization` (jaxinfer.layers.quantization), the LM
    head (the embedding when tied) in its head format (int8 under int4); a MoE router stays float
    (FLOAT_PROJECTIONS). Weights already quantized (a quantized checkpoint's) stay as they are."""
    if isinstance(quantization, str):
        quantization = Quantization(quantization)

    def quantize(w):
        return quantization.quantize(w) if isinstance(w, Dense) else w

    def quantize_layers(layers: dict) -> dict:  # a hybrid's "linear" and "attention" too
        return {
            name: quantize_layers(w)
            if isinstance(w, dict)
            else quantize(w)
            if name in LAYER_PROJECTIONS or name in HYBRID_PROJECTIONS
            else w
            for name, w in layers.items()
        }

    out = dict(tree)
    out["layers"] = quantize_layers(tree["layers"])
    head = head_name(config)
    if isinstance(tree[head], Dense):
        out[head] = quantization.head.quantize(tree[head])
    return out


def with_q4_blocks(tree: dict, blocks: dict) -> dict:
    """The tree with the int4 weights (groups of 32) named in `blocks` replaced by the GGUF
    file's own 4-bit blocks ({"layers": {name: BlockWeight "int4"}}, "out_in" rows, from
    Q4_0 / Q4_1 / Q4_K tensors): the same format, the file's values bit for bit rather than
    quantized again. scale and bias are stored as float16 where every value is one (Q4_0,
    Q4_1), else float32 (Q4_K's products d sc and dmin m)."""
    out = dict(tree)
    out["layers"] = dict(tree["layers"])
    for name, block in blocks["layers"].items():
        w = tree["layers"][name]
        if not isinstance(w, Int4) or w.group_size != 32:
            continue
        scale, bias = block.scales[..., 0], block.scales[..., 1]  # f32[L, N, K / 32]
        dtype = np.float16 if _in_float16(scale) and _in_float16(bias) else np.float32
        out["layers"][name] = Int4(
            block.qs.reshape(w.qs.shape),
            scale.reshape(w.scale.shape).astype(dtype),
            bias.reshape(w.bias.shape).astype(dtype),
            w.input_axis,
        )
    return out


def _in_float16(values: np.ndarray) -> bool:
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _device_normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_params(config: LlamaConfig, dtype, seed: int = 0, on_device: bool = False) -> dict:
    """A loader-shaped tree of random weights (benchmarks of shapes with no checkpoint).
    `on_device`: drawn by jax.random on the default device (an 8B-shaped tree takes minutes
    through numpy on the host) rather than numpy arrays."""
    rng = np.random.default_rng(seed)
    key, drawn = jax.random.key(seed), []
    layers, hidden = config.num_hidden_layers, config.hidden_size
    kv, head_dim = config.num_key_value_heads, config.head_dim
    qkv = (kv, config.num_attention_heads // kv + 2, head_dim)
    inter, vocab = config.dense_intermediate_size, config.vocab_size

    def normal(*shape):
        if on_device:
            drawn.append(shape)  # each array its own key
            return _device_normal(jax.random.fold_in(key, len(drawn)), shape, jnp.dtype(dtype))
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(dtype)

    params = {
        "embed": normal(vocab, hidden),
        "norm": np.ones(hidden, dtype),
        "layers": {
            "input_norm": np.ones((layers, hidden), dtype),
            "post_attention_norm": np.ones((layers, hidden), dtype),
            "qkv_proj": normal(layers, hidden, *qkv),
            "o_proj": normal(layers, config.q_size, hidden),
        },
    }
    if inter:
        params["layers"]["gate_up_proj"] = normal(layers, hidden, 2, inter)
        params["layers"]["down_proj"] = normal(layers, inter, hidden)
    if config.moe is not None:
        experts, expert_inter = config.moe.num_experts, config.moe.intermediate_size
        params["layers"]["router"] = normal(layers, hidden, experts)
        params["layers"]["experts_gate_up"] = normal(layers, experts, hidden, 2, expert_inter)
        params["layers"]["experts_down"] = normal(layers, experts, expert_inter, hidden)
        if config.moe.shared_expert_gate:
            params["layers"]["shared_expert_gate"] = normal(layers, hidden, 1)
    if config.qk_norm is not None:
        q, kv = (config.head_dim,) * 2
        if config.qk_norm == "all":
            q, kv = config.q_size, config.num_key_value_heads * config.head_dim
        params["layers"]["q_norm"] = np.ones((layers, q), dtype)
        params["layers"]["k_norm"] = np.ones((layers, kv), dtype)
    if config.attention_bias:
        params["layers"]["qkv_bias"] = normal(layers, *qkv)
    if not config.tie_word_embeddings:
        params["lm_head"] = normal(hidden, vocab)
    return params
