"""Qwen2-MoE (Qwen2MoeForCausalLM; GGUF "qwen2moe"): Qwen2's attention, and in every layer
routed experts beside a shared expert gated by a sigmoid."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import GGUFMetadata, ModelFamily
from jaxinfer.models.families.moe import moe_config, moe_fields_from_gguf
from jaxinfer.models.families.qwen2 import refuse_qwen_window


class Qwen2Moe(ModelFamily):
    name = "qwen2_moe"
    hf_architectures = ("Qwen2MoeForCausalLM",)
    gguf_architecture = "qwen2moe"

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        refuse_qwen_window(cfg, source)
        fields = super().config_fields(cfg, source)
        shared = cfg.get("shared_expert_intermediate_size", 0)
        moe = moe_config(
            cfg,
            source,
            renormalize=bool(cfg.get("norm_topk_prob")),
            intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            shared_intermediate_size=shared,
            shared_expert_gate=True,
        )
        if not shared:
            raise ValueError(f"{source}: Qwen2-MoE needs shared_expert_intermediate_size")
        return {**fields, "attention_bias": True, "moe": moe}

    def hf_config_from_gguf(self, meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp runs Qwen2-MoE's top-k weights as the softmax gives them
        fields = {**moe_fields_from_gguf(meta), "norm_topk_prob": False}
        return {**super().hf_config_from_gguf(meta), **fields}


FAMILY = Qwen2Moe()
