"""DeepSeek-V4 in tests: a tiny HF config of every layer kind's parts, and what HF's
compressors compute, in numpy (the pooling of a whole sequence's windows, the RMSNorm and
interleaved RoPE after it)."""

from __future__ import annotations

import numpy as np

HIDDEN, DIM, ROPE = 32, 16, 8  # hidden size, head dim, its RoPE'd trailing dims


def pool_sequence(kv: np.ndarray, gate: np.ndarray, bias: np.ndarray, overlap: bool) -> np.ndarray:
    """The entry of every whole window of one sequence: f32[L // m, D]."""
    ratio, features = bias.shape
    dim = features // 2 if overlap else features
    entries = []
    for w in range(len(kv) // ratio):
        own = slice(w * ratio, (w + 1) * ratio)
        slots_kv = kv[own, features - dim :]
        slots_gate = gate[own, features - dim :] + bias[:, features - dim :]
        if overlap:
            before = slice((w - 1) * ratio, w * ratio)
            before_kv = kv[before, :dim] if w else np.zeros((ratio, dim))
            before_gate = (
                gate[before, :dim] + bias[:, :dim] if w else np.full((ratio, dim), -np.inf)
            )
            slots_kv = np.concatenate([before_kv, slots_kv])
            slots_gate = np.concatenate([before_gate, slots_gate])
        weights = np.exp(slots_gate - slots_gate.max(axis=0))
        entries.append((weights / weights.sum(axis=0) * slots_kv).sum(axis=0))
    return np.asarray(entries)


def norm_and_rope(entries: np.ndarray, norm, ratio: int, config, rope_dim: int) -> np.ndarray:
    """What HF's compressors do after the pooling: the RMSNorm `norm` (a torch module), then
    the interleaved RoPE of the trailing `rope_dim` dims at each window's first position."""
    entries = entries / np.sqrt((entries**2).mean(-1, keepdims=True) + norm.variance_epsilon)
    entries = entries * norm.weight.detach().double().numpy()
    return rope(entries, np.arange(len(entries)) * ratio, config, rope_dim)


def rope(x: np.ndarray, positions: np.ndarray, config, rope_dim: int) -> np.ndarray:
    """DeepSeek-V4's interleaved RoPE (pairs of neighbouring dims) of x[..., -rope_dim:] at
    `positions` (x's first axis), with the compressed branches' base."""
    theta = config.rope_parameters["compress"]["rope_theta"]
    inv_freq = 1.0 / theta ** (np.arange(0, rope_dim, 2) / rope_dim)
    angles = positions[:, None] * inv_freq  # [N, rope_dim / 2]
    angles = angles.reshape(len(x), *([1] * (x.ndim - 2)), -1)
    pairs = x[..., -rope_dim:].reshape(*x.shape[:-1], rope_dim // 2, 2)
    first, second = pairs[..., 0], pairs[..., 1]
    cos, sin = np.cos(angles), np.sin(angles)
    rotated = np.stack([first * cos - second * sin, first * sin + second * cos], -1)
    return np.concatenate([x[..., :-rope_dim], rotated.reshape(*x.shape[:-1], rope_dim)], -1)


# Every layer kind twice, hash-routed MoE in the first two (a whole model's tests).
LAYER_TYPES = (
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)


def hf_config(layer_types: tuple[str, ...] | None = None, **overrides):
    """The tiny config; with `layer_types`, that many layers of those kinds."""
    import transformers

    layers = {} if layer_types is None else {"layer_types": list(layer_types)}
    fields = dict(
        vocab_size=64,
        hidden_size=HIDDEN,
        moe_intermediate_size=16,
        num_hidden_layers=2 if layer_types is None else len(layer_types),
        **layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=DIM,
        q_lora_rank=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        partial_rotary_factor=ROPE / DIM,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=4,
        sliding_window=8,
    )
    return transformers.DeepseekV4Config(**{**fields, **overrides})


def random_model(layer_types: tuple[str, ...] = LAYER_TYPES, seed: int = 0, **overrides):
    """A tiny DeepseekV4ForCausalLM with every weight drawn at a scale that makes each part
    count (HF's init zeroes the sinks, biases and position biases), the hash-routed layers'
    token -> experts tables random (distinct experts per token). 16 indexer heads: with few,
    a query's score of an entry is often exactly 0 (every head's ReLU cut), and torch.topk
    breaks such ties otherwise than jax.lax.top_k (the lower index)."""
    import torch
    import transformers

    config = hf_config(layer_types, **{"index_n_heads": 16, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    experts, k = config.n_routed_experts, config.num_experts_per_tok
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=generator)[:k] for _ in tensor]
                tensor.copy_(torch.stack(rows))
            elif "norm" in name or name.endswith("scale"):
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
    return model
