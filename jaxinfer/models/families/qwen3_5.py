"""The hybrid Qwen families (jaxinfer.models.qwen3_5): Qwen3.5 (Qwen3_5ForCausalLM, text),
its MoE form (Qwen3_5MoeForCausalLM) and Qwen3-Next (Qwen3NextForCausalLM). Gated DeltaNet
layers and gated full-attention layers as layer_types lists them (three linear, then one
full); every norm but the linear layers' gated one multiplies by (1 + w); q and k normalized
per head; RoPE on partial_rotary_factor of each head (a text-only prompt's multimodal RoPE
is the plain one: every section sees the same position). The MoE forms have routed experts (the
top-k weights renormalized) beside a shared expert gated by a sigmoid, in every layer.
Qwen3.5 splits the linear layers' input projections (in_proj_qkv, _z, _b, _a); Qwen3-Next
interleaves them per key head (in_proj_qkvz, in_proj_ba)."""

from __future__ import annotations

from typing import Any

from jaxinfer.arch_config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    HybridLayers,
    LinearAttentionShape,
)
from jaxinfer.models.families.family import ModelFamily, refuse_activation
from jaxinfer.models.families.moe import moe_config


class Qwen3_5(ModelFamily):
    name = "qwen3_5_text"
    hf_architectures = ("Qwen3_5ForCausalLM",)
    projections = "split"
    moe = False

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        refuse_activation(cfg, source)
        if cfg.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias is not supported on {self.name}")
        fields = {"qk_norm": "head", "norm_offset": 1.0, "hybrid": self.hybrid(cfg, source)}
        if self.moe:
            fields["moe"] = moe_config(
                cfg,
                source,
                renormalize=bool(cfg.get("norm_topk_prob", True)),
                intermediate_size=cfg["moe_intermediate_size"],
                shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")),
            )
        return fields

    def hybrid(self, cfg: dict[str, Any], source: str) -> HybridLayers:
        layers = cfg["num_hidden_layers"]
        interval = cfg.get("full_attention_interval", 4)
        types = cfg.get("layer_types") or [
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
        ]
        rope = cfg.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        try:
            return HybridLayers(
                layer_types=tuple(types),
                linear=LinearAttentionShape(
                    cfg["linear_num_key_heads"],
                    cfg["linear_num_value_heads"],
                    cfg["linear_key_head_dim"],
                    cfg["linear_value_head_dim"],
                    cfg["linear_conv_kernel_dim"],
                    cfg.get("rms_norm_eps", 1e-6),
                ),
                rotary_dim=int(head_dim * partial),
                projections=self.projections,
            )
        except KeyError as missing:
            raise ValueError(f"{source}: {self.name} needs {missing}") from None
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe_text"
    hf_architectures = ("Qwen3_5MoeForCausalLM",)
    moe = True


class Qwen3Next(Qwen3_5):
    name = "qwen3_next"
    hf_architectures = ("Qwen3NextForCausalLM",)
    projections = "interleaved"
    moe = True


FAMILIES = (Qwen3_5(), Qwen3_5Moe(), Qwen3Next())
