"""A model folder for a named shape (jaxinfer.models.shapes) with no weights: config.json and a
small tokenizer, for the engine with load_format "dummy" (tools.bench_shape,
tools.invariance_check)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.arch_config import LlamaConfig
from tools.tiny_tokenizer import write_tiny_tokenizer


def hf_config(cfg: LlamaConfig) -> dict:
    """The shape as a Hugging Face config.json."""
    config = dict(
        architectures=[cfg.architecture],
        model_type="llama",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        bos_token_id=1,
        eos_token_id=2,
    )
    if cfg.rope_scaling is not None:
        scaling = cfg.rope_scaling
        config["rope_scaling"] = dict(
            rope_type=scaling.rope_type,
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    return config


def write_folder(folder: Path, cfg: LlamaConfig) -> None:
    (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    write_tiny_tokenizer(folder, 300)
