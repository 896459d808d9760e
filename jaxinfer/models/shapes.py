"""Architectures by name, for random-weight benchmarks (no checkpoint needed)."""

from __future__ import annotations

from jaxinfer.arch_config import LlamaConfig, RopeScaling

SHAPES = {
    "smollm2": LlamaConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
    ),
    "llama3_8b": LlamaConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    ),
}


def shape(name: str) -> LlamaConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    return SHAPES[name]
