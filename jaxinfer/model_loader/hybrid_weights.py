"""A hybrid model's own layers from a Hugging Face checkpoint (jaxinfer.models.qwen3_5): the
linear-attention layers' and the attention layers' parameters, each kind's layers stacked,
projections "in_out" (x @ W). The shared parts (norms, FFN or experts, embeddings) are read
as the Llama decoder's (jaxinfer.model_loader.safetensors_loader)."""

from __future__ import annotations

import numpy as np

from jaxinfer.arch_config import FULL_ATTENTION, LINEAR_ATTENTION, LlamaConfig

SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
INTERLEAVED = ("in_proj_qkvz", "in_proj_ba")


def load_hybrid_layers(reader, config: LlamaConfig, dtype) -> dict:
    """{"linear": {...} [Ll, ...], "attention": {...} [La, ...]} from `reader` (tensors by
    name: get(name, shape, dtype)); a kind the model has no layers of is left out."""
    cfg, hybrid = config, config.hybrid
    s = hybrid.linear
    E, D = cfg.hidden_size, cfg.head_dim
    hk, hv, dk, dv = s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim
    offset = np.asarray(cfg.norm_offset, dtype)
    linear_out = {
        "in_proj_qkv": 2 * hk * dk + hv * dv,
        "in_proj_z": hv * dv,
        "in_proj_b": hv,
        "in_proj_a": hv,
        "in_proj_qkvz": 2 * hk * dk + 2 * hv * dv,
        "in_proj_ba": 2 * hv,
    }

    def get(name, shape):
        return reader.get(name, shape, dtype)

    def linear(p):
        p += "linear_attn."
        names = SPLIT if hybrid.projections == "split" else INTERLEAVED
        out = {n: get(f"{p}{n}.weight", (linear_out[n], E)).T for n in names}
        out["conv1d"] = get(p + "conv1d.weight", (s.conv_channels, 1, s.conv_kernel))[:, 0]
        out["dt_bias"] = get(p + "dt_bias", (hv,))
        out["A_log"] = get(p + "A_log", (hv,))
        out["norm"] = get(p + "norm.weight", (dv,))  # the gated norm multiplies by w
        out["out_proj"] = get(p + "out_proj.weight", (E, hv * dv)).T
        return out

    def attention(p):
        p += "self_attn."
        kv = cfg.num_key_value_heads * D
        return {
            "q_proj": get(p + "q_proj.weight", (2 * cfg.q_size, E)).T,
            "k_proj": get(p + "k_proj.weight", (kv, E)).T,
            "v_proj": get(p + "v_proj.weight", (kv, E)).T,
            "o_proj": get(p + "o_proj.weight", (E, cfg.q_size)).T,
            "q_norm": get(p + "q_norm.weight", (D,)) + offset,
            "k_norm": get(p + "k_norm.weight", (D,)) + offset,
        }

    def stacked(kind, fn):
        layers = [fn(f"model.layers.{i}.") for i, t in enumerate(hybrid.layer_types) if t == kind]
        return {n: np.ascontiguousarray(np.stack([la[n] for la in layers])) for n in layers[0]}

    kinds = {"linear": (LINEAR_ATTENTION, linear), "attention": (FULL_ATTENTION, attention)}
    return {name: stacked(kind, fn) for name, (kind, fn) in kinds.items() if hybrid.count(kind)}
