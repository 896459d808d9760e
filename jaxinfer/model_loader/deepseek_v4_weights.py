"""DeepSeek-V4's parameter tree (jaxinfer.models.deepseek_v4) from its checkpoint, which keeps
DeepSeek's tensor names (`layers.3.attn.wq_a.weight`, `layers.3.ffn.experts.0.w1.weight`,
`hc_head_fn`, ...), with or without transformers' `model.` prefix.

Projections are "in_out" ([in, out], x @ W), every layer kind's stacked:

    embed [V, E], lm_head [E, V], norm [E], hc_head {fn [N, N * E], base [N], scale [1]}
    layers (all L):
        input_norm, post_attention_norm [L, E]; attn_hc, ffn_hc {fn [L, (2 + N) * N, N * E],
        base [L, (2 + N) * N], scale [L, 3]}
        q_a_proj [L, E, Rq], q_a_norm [L, Rq], q_b_proj [L, Rq, H * D]
        kv_proj [L, E, D], kv_norm [L, D], sinks [L, H]
        o_a_proj [L, G, H * D / G, Ro] (each head group's own), o_b_proj [L, G * Ro, E]
        router [L, E, X], router_bias [L, X] (zeros in hash-routed layers),
        experts_gate_up [L, X, E, 2, I], experts_down [L, X, I, E],
        gate_up_proj [L, E, 2, I], down_proj [L, I, E] (the shared expert)
    layers["hash"] (the hash-routed layers): tid2eid i32[Lh, V, k]
    layers["hca"] (heavily compressed): kv_proj, gate_proj [Lh, E, D], position_bias
        [Lh, m, D], kv_norm [Lh, D]
    layers["csa"] (compressed sparse): kv_proj, gate_proj [Lc, E, 2D], position_bias
        [Lc, m, 2D], kv_norm [Lc, D], and the indexer's index_kv_proj, index_gate_proj
        [Lc, E, 2Di], index_position_bias [Lc, m, 2Di], index_kv_norm [Lc, Di],
        index_q_b_proj [Lc, Rq, Hi * Di], index_weights_proj [Lc, E, Hi]
"""

from __future__ import annotations

import numpy as np

from jaxinfer.arch_config import (
    COMPRESSED_SPARSE_ATTENTION,
    HASH_MOE,
    HEAVILY_COMPRESSED_ATTENTION,
    LlamaConfig,
)


class _Checkpoint:
    """The checkpoint's tensors by DeepSeek's names, as this tree's parameters."""

    def __init__(self, reader, config: LlamaConfig, dtype):
        self.reader, self.config, self.dtype = reader, config, dtype

    def name(self, n: str) -> str:
        for candidate in ("model." + n, n):
            if self.reader.has(candidate):
                return candidate
        return n  # (get's error names it)

    def has(self, n: str) -> bool:
        return self.reader.has(self.name(n))

    def get(self, n, shape, as_dtype=None):
        return self.reader.get(self.name(n), shape, self.dtype if as_dtype is None else as_dtype)

    def either(self, transformers_name, deepseek_name, shape, as_dtype=None):
        n = transformers_name if self.has(transformers_name) else deepseek_name
        return self.get(n, shape, as_dtype)

    def linear(self, n, out, inp):  # [out, in] -> [in, out]
        return self.get(n + ".weight", (out, inp)).T

    def hyper(self, p, kind):
        E, N = self.config.hidden_size, self.config.compressed.hc_mult
        size = (2 + N) * N
        return {
            "fn": self.get(f"{p}hc_{kind}_fn", (size, N * E), np.float32),
            "base": self.get(f"{p}hc_{kind}_base", (size,), np.float32),
            "scale": self.get(f"{p}hc_{kind}_scale", (3,), np.float32),
        }

    def gate_up(self, p):  # [E, 2, I]
        E, I = self.config.hidden_size, self.config.moe.intermediate_size  # noqa: E741
        return np.stack([self.linear(p + "w1", I, E), self.linear(p + "w3", I, E)], axis=1)

    def layer(self, p: str) -> dict:
        """One layer's shared parameters, its tensors named `p` + ("attn_norm.weight", ...)."""
        cfg, v4 = self.config, self.config.compressed
        E, H, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        Rq, G, Ro = v4.q_lora_rank, v4.o_groups, v4.o_lora_rank
        X, I = cfg.moe.num_experts, cfg.moe.intermediate_size  # noqa: E741
        get, linear, a = self.get, self.linear, p + "attn."
        bias = p + "ffn.gate.bias"
        return {
            "input_norm": get(p + "attn_norm.weight", (E,)),
            "post_attention_norm": get(p + "ffn_norm.weight", (E,)),
            "attn_hc": self.hyper(p, "attn"),
            "ffn_hc": self.hyper(p, "ffn"),
            "q_a_proj": linear(a + "wq_a", Rq, E),
            "q_a_norm": get(a + "q_norm.weight", (Rq,)),
            "q_b_proj": linear(a + "wq_b", H * D, Rq),
            "kv_proj": linear(a + "wkv", D, E),
            "kv_norm": get(a + "norm.weight", (D,)),
            "sinks": get(a + "attn_sink", (H,), np.float32),
            # [G * Ro, H * D / G] -> each group's [H * D / G, Ro]
            "o_a_proj": get(a + "wo_a.weight", (G * Ro, H * D // G))
            .reshape(G, Ro, -1)
            .transpose(0, 2, 1),
            "o_b_proj": linear(a + "wo_b", E, G * Ro),
            "router": linear(p + "ffn.gate", X, E),
            "router_bias": (
                get(bias, (X,), np.float32) if self.has(bias) else np.zeros(X, np.float32)
            ),
            "experts_gate_up": np.stack([self.gate_up(f"{p}ffn.experts.{e}.") for e in range(X)]),
            "experts_down": np.stack([linear(f"{p}ffn.experts.{e}.w2", E, I) for e in range(X)]),
            "gate_up_proj": self.gate_up(p + "ffn.shared_experts."),
            "down_proj": linear(p + "ffn.shared_experts.w2", E, I),
        }

    def head(self, p: str) -> dict:
        """A final collapse's parameters (hc_head), named `p` + "hc_head_fn" and so on."""
        E, N = self.config.hidden_size, self.config.compressed.hc_mult
        f32 = np.float32
        return {
            "fn": self.either(f"{p}hc_head.hc_fn", f"{p}hc_head_fn", (N, N * E), f32),
            "base": self.either(f"{p}hc_head.hc_base", f"{p}hc_head_base", (N,), f32),
            "scale": self.either(f"{p}hc_head.hc_scale", f"{p}hc_head_scale", (1,), f32),
        }


def load_deepseek_v4(reader, config: LlamaConfig, dtype) -> dict:
    """The tree above from `reader` (tensors by name: has, get(name, shape, dtype))."""
    checkpoint = _Checkpoint(reader, config, dtype)
    cfg, v4, moe = config, config.compressed, config.moe
    E, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    k, Hi, Di, Rq = moe.top_k, v4.index_heads, v4.index_head_dim, v4.q_lora_rank
    get, linear, either = checkpoint.get, checkpoint.linear, checkpoint.either

    def compressor(p, dim, series, ratio):
        return {
            "kv_proj": linear(p + "wkv", series * dim, E),
            "gate_proj": linear(p + "wgate", series * dim, E),
            "position_bias": get(p + "ape", (ratio, series * dim), np.float32),
            "kv_norm": get(p + "norm.weight", (dim,)),
        }

    def hca(i):
        return compressor(
            f"layers.{i}.attn.compressor.", D, 1, v4.ratio(HEAVILY_COMPRESSED_ATTENTION)
        )

    def csa(i):
        a = f"layers.{i}.attn."
        ratio = v4.ratio(COMPRESSED_SPARSE_ATTENTION)
        index = compressor(a + "indexer.compressor.", Di, 2, ratio)
        return {
            **compressor(a + "compressor.", D, 2, ratio),
            **{"index_" + n: w for n, w in index.items()},
            "index_q_b_proj": linear(a + "indexer.wq_b", Hi * Di, Rq),
            "index_weights_proj": linear(a + "indexer.weights_proj", Hi, E),
        }

    def hashed(i):
        return get(f"layers.{i}.ffn.gate.tid2eid", (V, k), np.int64).astype(np.int32)

    def stacked(trees):
        if isinstance(trees[0], dict):
            return {n: stacked([t[n] for t in trees]) for n in trees[0]}
        return np.ascontiguousarray(np.stack(trees))

    types, layers = v4.layer_types, range(cfg.num_hidden_layers)
    tree = stacked([checkpoint.layer(f"layers.{i}.") for i in layers])
    for key, kind, fn in (
        ("hca", HEAVILY_COMPRESSED_ATTENTION, hca),
        ("csa", COMPRESSED_SPARSE_ATTENTION, csa),
    ):
        if v4.count(kind):
            tree[key] = stacked([fn(i) for i in layers if types[i] == kind])
    hashed_layers = [i for i in layers if v4.mlp_layer_types[i] == HASH_MOE]
    if hashed_layers:
        tree["hash"] = {"tid2eid": stacked([hashed(i) for i in hashed_layers])}
    return {
        "layers": tree,
        "embed": either("embed_tokens.weight", "embed.weight", (V, E)),
        "lm_head": np.ascontiguousarray(get("head.weight", (V, E)).T),
        "norm": get("norm.weight", (E,)),
        "hc_head": checkpoint.head(""),
    }


MTP_PREFIX = "mtp.0."  # the checkpoint's multi-token-prediction layer (DeepSeek's names)


def load_deepseek_v4_mtp(reader, config: LlamaConfig, dtype) -> dict | None:
    """The multi-token-prediction layer's parameters (jaxinfer.models.deepseek_v4_mtp), or
    None where the checkpoint has none (transformers drops `mtp.*` on load and writes none):

        enorm, hnorm, norm [E]; e_proj, h_proj [E, E] ("in_out"); hc_head {fn, base,
        scale}; layer: one decoder layer's shared parameters (as one of layers' above)

    Its embedding and LM head are the model's."""
    checkpoint = _Checkpoint(reader, config, dtype)
    p, E = MTP_PREFIX, config.hidden_size
    if not checkpoint.has(p + "e_proj.weight"):
        return None
    return {
        "enorm": checkpoint.get(p + "enorm.weight", (E,)),
        "hnorm": checkpoint.get(p + "hnorm.weight", (E,)),
        "norm": checkpoint.get(p + "norm.weight", (E,)),
        "e_proj": checkpoint.linear(p + "e_proj", E, E),
        "h_proj": checkpoint.linear(p + "h_proj", E, E),
        "hc_head": checkpoint.head(p),
        "layer": checkpoint.layer(p),
    }
