"""Qwen3 (Qwen3ForCausalLM; GGUF "qwen3"): Llama with an RMSNorm of each head's q and k
before RoPE."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import ModelFamily
from jaxinfer.models.families.qwen2 import refuse_qwen_window


class Qwen3(ModelFamily):
    name = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_architecture = "qwen3"

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        refuse_qwen_window(cfg, source)
        return {**super().config_fields(cfg, source), "qk_norm": "head"}


FAMILY = Qwen3()
