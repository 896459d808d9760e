"""The mixture-of-experts fields the MoE families share: their config.json's and llama.cpp's
GGUF metadata keys."""

from __future__ import annotations

from typing import Any

from jaxinfer.arch_config import MoeConfig, RouterConfig
from jaxinfer.models.families.family import GGUFMetadata


def moe_config(
    cfg: dict[str, Any],
    source: str,
    *,
    renormalize: bool,
    intermediate_size: int,
    default_top_k: int = 8,
    shared_intermediate_size: int = 0,
    shared_expert_gate: bool = False,
) -> MoeConfig:
    """Every layer's MoE FFN (dense layers between MoE layers are refused)."""
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{source}: dense layers between MoE layers (mlp_only_layers, decoder_sparse_step) "
            "are not supported: every layer must be a MoE layer"
        )
    # transformers writes num_local_experts (recent versions) or num_experts
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not num_experts:
        raise ValueError(f"{source}: a MoE config needs num_local_experts or num_experts")
    top_k = cfg.get("num_experts_per_tok", default_top_k)
    return MoeConfig(
        router=RouterConfig(num_experts=num_experts, top_k=top_k, renormalize=renormalize),
        intermediate_size=intermediate_size,
        shared_intermediate_size=shared_intermediate_size,
        shared_expert_gate=shared_expert_gate,
    )


def moe_fields_from_gguf(meta: GGUFMetadata) -> dict[str, Any]:
    """config.json's expert fields from llama.cpp's keys."""
    fields = {
        "num_experts": int(meta.arch_require("expert_count")),
        "num_local_experts": int(meta.arch_require("expert_count")),
        "num_experts_per_tok": int(meta.arch_require("expert_used_count")),
    }
    if meta.arch("expert_feed_forward_length"):
        fields["moe_intermediate_size"] = int(meta.arch("expert_feed_forward_length"))
    if meta.arch("expert_shared_feed_forward_length"):
        fields["shared_expert_intermediate_size"] = int(
            meta.arch("expert_shared_feed_forward_length")
        )
    return fields
