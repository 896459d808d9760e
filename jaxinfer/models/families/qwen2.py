"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM; GGUF "qwen2"): Llama with a QKV bias. Qwen's sliding
window (on the layers from max_window_layers) is refused."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import ModelFamily


class Qwen2(ModelFamily):
    name = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_architecture = "qwen2"

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        refuse_qwen_window(cfg, source)
        return {**super().config_fields(cfg, source), "attention_bias": True}


def refuse_qwen_window(cfg: dict[str, Any], source: str) -> None:
    if cfg.get("use_sliding_window"):
        raise ValueError(
            f"{source}: Qwen's sliding window (on layers from max_window_layers) is not supported"
        )


FAMILY = Qwen2()
