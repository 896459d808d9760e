"""A hybrid model's own layers from a Hugging Face checkpoint (jaxinfer.models.qwen3_5): the
linear-attention layers' and the attention layers' parameters, each kind's layers stacked,
projections "in_out" (x @ W). The shared parts (norms, FFN or experts, embeddings) are read
as the Llama decoder's (jaxinfer.model_loader.safetensors_loader).

A linear layer's weights are put in one layout for both checkpoint forms (Qwen3.5's split
in_proj_qkv / _z / _b / _a, Qwen3-Next's interleaved in_proj_qkvz / _ba), grouped by key
head so that splitting the heads over devices gives each device whole groups (tensor
parallelism):
    in_proj_qkv [E, Hk * (2 Dk + G Dv)]  per key head: its q, its k, its G value heads' v
    in_proj_z   [E, Hv * Dv];  in_proj_b, in_proj_a [E, Hv]  (value heads in order: G per key head)
    conv1d      [C, K]  its channels in in_proj_qkv's order
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxinfer.arch_config import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionShape, LlamaConfig


def _grouped_qkv(x: np.ndarray, s: LinearAttentionShape) -> np.ndarray:
    """[q of every key head | k of every key head | v of every value head, ...] (the first
    axis) -> per key head q, k, v, flattened: the checkpoints' channel order to ours."""
    hk, dk, g, dv = s.num_k_heads, s.k_head_dim, s.num_v_heads // s.num_k_heads, s.v_head_dim
    rest = x.shape[1:]
    q = x[: hk * dk].reshape(hk, dk, *rest)
    k = x[hk * dk : 2 * hk * dk].reshape(hk, dk, *rest)
    v = x[2 * hk * dk :].reshape(hk, g * dv, *rest)
    return np.concatenate([q, k, v], axis=1).reshape(-1, *rest)


def linear_layer(
    get: Callable[[str, tuple], np.ndarray],
    prefix: str,
    s: LinearAttentionShape,
    hidden_size: int,
    projections: str,
) -> dict:
    """One linear layer's parameters from `get(name, shape)` (the checkpoint's tensors under
    `prefix`, as HF names them), in the layout above."""
    E = hidden_size
    hk, hv, dk, dv = s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim
    g = hv // hk
    if projections == "split":
        qkv = _grouped_qkv(get(prefix + "in_proj_qkv.weight", (2 * hk * dk + hv * dv, E)), s)
        z = get(prefix + "in_proj_z.weight", (hv * dv, E))
        b = get(prefix + "in_proj_b.weight", (hv, E))
        a = get(prefix + "in_proj_a.weight", (hv, E))
    else:  # per key head: q, k, v (G Dv), z (G Dv); then per key head b (G), a (G)
        qkvz = get(prefix + "in_proj_qkvz.weight", (hk * (2 * dk + 2 * g * dv), E))
        qkvz = qkvz.reshape(hk, 2 * dk + 2 * g * dv, E)
        qkv = qkvz[:, : 2 * dk + g * dv].reshape(-1, E)
        z = qkvz[:, 2 * dk + g * dv :].reshape(-1, E)
        ba = get(prefix + "in_proj_ba.weight", (2 * hv, E)).reshape(hk, 2 * g, E)
        b, a = ba[:, :g].reshape(-1, E), ba[:, g:].reshape(-1, E)
    conv = get(prefix + "conv1d.weight", (s.conv_channels, 1, s.conv_kernel))[:, 0]
    return {
        "in_proj_qkv": qkv.T,
        "in_proj_z": z.T,
        "in_proj_b": b.T,
        "in_proj_a": a.T,
        "conv1d": _grouped_qkv(conv, s),
        "dt_bias": get(prefix + "dt_bias", (hv,)),
        "A_log": get(prefix + "A_log", (hv,)),
        "norm": get(prefix + "norm.weight", (dv,)),  # the gated norm multiplies by w
        "out_proj": get(prefix + "out_proj.weight", (E, hv * dv)).T,
    }


def load_hybrid_layers(reader, config: LlamaConfig, dtype) -> dict:
    """{"linear": {...} [Ll, ...], "attention": {...} [La, ...]} from `reader` (tensors by
    name: get(name, shape, dtype)); a kind the model has no layers of is left out."""
    cfg, hybrid = config, config.hybrid
    E, D = cfg.hidden_size, cfg.head_dim
    offset = np.asarray(cfg.norm_offset, dtype)

    def get(name, shape):
        return reader.get(name, shape, dtype)

    def linear(p):
        return linear_layer(get, p + "linear_attn.", hybrid.linear, E, hybrid.projections)

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
