"""Mixtral (MixtralForCausalLM; llama.cpp's "llama" GGUF architecture with experts): Mistral's
attention and a MoE FFN in every layer, its top-k weights always renormalized."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import GGUFMetadata, ModelFamily
from jaxinfer.models.families.mistral import sliding_window
from jaxinfer.models.families.moe import moe_config, moe_fields_from_gguf


class Mixtral(ModelFamily):
    name = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    gguf_architecture = "llama"
    gguf_qk_permuted = True
    expert_names = ("block_sparse_moe.", ("w1", "w3", "w2"))

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        moe = moe_config(
            cfg,
            source,
            renormalize=True,
            intermediate_size=cfg["intermediate_size"],
            default_top_k=2,
        )
        return {**super().config_fields(cfg, source), **sliding_window(cfg), "moe": moe}

    def matches_gguf(self, meta: GGUFMetadata) -> bool:
        return bool(meta.arch("expert_count"))

    def hf_config_from_gguf(self, meta: GGUFMetadata) -> dict[str, Any]:
        config = {**super().hf_config_from_gguf(meta), **moe_fields_from_gguf(meta)}
        if config.get("moe_intermediate_size"):
            config["intermediate_size"] = config.pop("moe_intermediate_size")
        return config


FAMILY = Mixtral()
