"""Gemma 3, text (Gemma3ForCausalLM; GGUF "gemma3"): local (sliding-window) and global layers
interleaved (five local, then one global, unless layer_types says otherwise), each kind with
its own RoPE base (the global's scaled, where the config scales it); an RMSNorm of each
head's q and k; four norms per layer (before and after the attention and the FFN), every
norm multiplying by (1 + w); a GELU-tanh gate; the embeddings scaled by sqrt(E); q.k scaled
by query_pre_attn_scalar ** -0.5; the embeddings tied to the LM head.

llama.cpp stores Gemma's norms as 1 + w; the GGUF reader gives them back as transformers
stores them (w)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxinfer.models.families.family import GGUFMetadata, ModelFamily, rope_scaling

SLIDING, FULL = "sliding_attention", "full_attention"
# llama.cpp's Gemma 3 defaults, which its files do not carry
GGUF_SLIDING_PATTERN = 6
GGUF_LOCAL_ROPE_THETA = 10_000.0


class Gemma3(ModelFamily):
    name = "gemma3_text"
    hf_architectures = ("Gemma3ForCausalLM",)
    gguf_architecture = "gemma3"
    gguf_tokenizers = ("llama", "gpt2")  # its files' SentencePiece; byte-level BPE reads too
    layer_norms = {  # noqa: RUF012 (read only)
        "input_norm": "input_layernorm",
        "attention_output_norm": "post_attention_layernorm",
        "post_attention_norm": "pre_feedforward_layernorm",  # the model's pre-FFN norm
        "ffn_output_norm": "post_feedforward_layernorm",
    }

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{source}: hidden_activation {act!r} is not supported (gelu tanh)")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ValueError(f"{source}: {key} is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: bidirectional attention is not supported")
        layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            SLIDING if (i + 1) % cfg.get("sliding_window_pattern", 6) else FULL
            for i in range(layers)
        ]
        if set(types) - {SLIDING, FULL} or len(types) != layers:
            raise ValueError(f"{source}: layer_types {types} are not {layers} of {SLIDING, FULL}")
        params = cfg.get("rope_parameters") or {}
        full = params.get(FULL) or {}
        local = params.get(SLIDING) or {}
        theta = full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0
        local_theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: a scaled RoPE on the sliding layers is not supported")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return {
            "qk_norm": "head",
            "hidden_act": "gelu_tanh",
            "sliding_window": cfg.get("sliding_window"),
            "sliding_layers": tuple(t == SLIDING for t in types),
            "rope_theta": float(theta),
            "rope_local_theta": float(local_theta),
            "rope_scaling": rope_scaling(full or cfg.get("rope_scaling"), source),
            "embedding_scale": math.sqrt(cfg["hidden_size"]),
            "attention_scale": cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,
            "sandwich_norms": True,
            "norm_offset": 1.0,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
        }

    def hf_config_from_gguf(self, meta: GGUFMetadata) -> dict[str, Any]:
        config = super().hf_config_from_gguf(meta)
        layers = config["num_hidden_layers"]
        window = meta.arch("attention.sliding_window")
        config.update(
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(window) if window else None,
            layer_types=[
                SLIDING if window and (i + 1) % GGUF_SLIDING_PATTERN else FULL
                for i in range(layers)
            ],
            rope_local_base_freq=GGUF_LOCAL_ROPE_THETA,
            query_pre_attn_scalar=config["head_dim"],
        )
        return config

    def gguf_layer_tensors(self) -> dict[str, str]:
        return {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }

    def hf_tensor_from_gguf(self, hf_name: str, value: np.ndarray) -> np.ndarray:
        return value - np.float32(1) if hf_name.endswith("norm.weight") else value


FAMILY = Gemma3()
