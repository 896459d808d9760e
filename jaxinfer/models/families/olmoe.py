"""OLMoE (OlmoeForCausalLM; GGUF "olmoe"): an RMSNorm of q and of k over all their heads
together, q, k and v clipped to [-clip_qkv, clip_qkv], and a MoE FFN in every layer."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import GGUFMetadata, ModelFamily
from jaxinfer.models.families.moe import moe_config, moe_fields_from_gguf


class Olmoe(ModelFamily):
    name = "olmoe"
    hf_architectures = ("OlmoeForCausalLM",)
    gguf_architecture = "olmoe"

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        moe = moe_config(
            cfg,
            source,
            renormalize=bool(cfg.get("norm_topk_prob")),
            intermediate_size=cfg["intermediate_size"],
        )
        fields = {"qk_norm": "all", "clip_qkv": cfg.get("clip_qkv"), "moe": moe}
        return {**super().config_fields(cfg, source), **fields}

    def hf_config_from_gguf(self, meta: GGUFMetadata) -> dict[str, Any]:
        fields = moe_fields_from_gguf(meta)
        fields["intermediate_size"] = fields.pop("moe_intermediate_size", None) or int(
            meta.arch_require("feed_forward_length")
        )
        fields["norm_topk_prob"] = False  # as llama.cpp runs it
        if meta.arch("attention.clamp_kqv"):
            fields["clip_qkv"] = float(meta.arch("attention.clamp_kqv"))
        return {**super().hf_config_from_gguf(meta), **fields}


FAMILY = Olmoe()
