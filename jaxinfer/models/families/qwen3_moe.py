"""Qwen3-MoE (Qwen3MoeForCausalLM; GGUF "qwen3moe"): Qwen3's attention and a MoE FFN in every
layer, without a shared expert."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import GGUFMetadata, ModelFamily
from jaxinfer.models.families.moe import moe_config, moe_fields_from_gguf
from jaxinfer.models.families.qwen2 import refuse_qwen_window


class Qwen3Moe(ModelFamily):
    name = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_architecture = "qwen3moe"

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        refuse_qwen_window(cfg, source)
        moe = moe_config(
            cfg,
            source,
            renormalize=bool(cfg.get("norm_topk_prob")),
            intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        )
        return {**super().config_fields(cfg, source), "qk_norm": "head", "moe": moe}

    def hf_config_from_gguf(self, meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp always renormalizes Qwen3-MoE's top-k weights
        fields = {**moe_fields_from_gguf(meta), "norm_topk_prob": True}
        return {**super().hf_config_from_gguf(meta), **fields}


FAMILY = Qwen3Moe()
