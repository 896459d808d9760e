"""DeepSeek-V4 (DeepseekV4ForCausalLM; jaxinfer.models.deepseek_v4): shared-KV attention over a
sliding window in every layer, compressed entries beside it in the compressed layers (CSA's
top-k picked by the Lightning Indexer, HCA's all), hyper-connections, and a MoE FFN in every
layer (sqrt(softplus) scores, hash-routed first layers, a shared expert, swiglu_limit).

Its checkpoints keep DeepSeek's own tensor names (attn.wq_a, ffn.experts.0.w1, hc_attn_fn,
...), which transformers maps onto its modules on load; jaxinfer.model_loader
.deepseek_v4_weights reads them."""

from __future__ import annotations

from typing import Any

from jaxinfer.arch_config import (
    COMPRESSED_KINDS,
    HASH_MOE,
    CompressedLayers,
    MoeConfig,
    RouterConfig,
)
from jaxinfer.models.families.family import ModelFamily, refuse_activation, rope_scaling


class DeepseekV4(ModelFamily):
    name = "deepseek_v4"
    hf_architectures = ("DeepseekV4ForCausalLM",)

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        refuse_activation(cfg, source)
        if cfg.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"{source}: {self.name} has one shared K=V head")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"{source}: {flag} is not supported on {self.name}")
        main = (cfg.get("rope_parameters") or {}).get("main") or {}
        if main.get("rope_type", "default") != "default":
            raise ValueError(
                f"{source}: {self.name}'s main RoPE of type {main['rope_type']!r} is not "
                "supported (default only; the compressed layers' may be YaRN)"
            )
        try:
            return {
                "intermediate_size": cfg["moe_intermediate_size"],  # the shared expert's
                "sliding_window": int(cfg["sliding_window"]),
                "moe": self.moe(cfg),
                "compressed": self.layers(cfg, source),
            }
        except KeyError as missing:
            raise ValueError(f"{source}: {self.name} needs {missing}") from None
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    def moe(self, cfg: dict[str, Any]) -> MoeConfig:
        if cfg.get("n_shared_experts", 1) != 1:
            raise ValueError(f"n_shared_experts {cfg['n_shared_experts']} is not supported (1)")
        width = cfg["moe_intermediate_size"]
        router = RouterConfig(
            num_experts=cfg["n_routed_experts"],
            top_k=cfg["num_experts_per_tok"],
            scoring=cfg.get("scoring_func", "sqrtsoftplus"),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            correction_bias=True,
        )
        limit = cfg.get("swiglu_limit")
        return MoeConfig(
            router=router,
            intermediate_size=width,
            shared_intermediate_size=width,
            swiglu_limit=None if limit is None else float(limit),
        )

    def layers(self, cfg: dict[str, Any], source: str) -> CompressedLayers:
        layers = cfg["num_hidden_layers"]
        types = tuple(cfg["layer_types"])
        mlp_types = tuple(cfg.get("mlp_layer_types") or ["moe"] * layers)
        if len(types) != layers:
            raise ValueError(f"{len(types)} layer_types for {layers} layers")
        partial = cfg.get("partial_rotary_factor") or 1.0
        rates = cfg.get("compress_rates") or {}
        if HASH_MOE in mlp_types and not cfg.get("vocab_size"):
            raise ValueError("hash-routed layers need vocab_size")
        return CompressedLayers(
            layer_types=types,
            mlp_layer_types=mlp_types,
            ratios=tuple((kind, int(rates[kind])) for kind in COMPRESSED_KINDS if kind in types),
            rotary_dim=int(cfg["head_dim"] * partial),
            compress_rope_theta=float(cfg.get("compress_rope_theta", 160000.0)),
            q_lora_rank=cfg["q_lora_rank"],
            o_groups=cfg["o_groups"],
            o_lora_rank=cfg["o_lora_rank"],
            index_heads=cfg["index_n_heads"],
            index_head_dim=cfg["index_head_dim"],
            index_topk=cfg["index_topk"],
            hc_mult=cfg["hc_mult"],
            hc_sinkhorn_iters=cfg["hc_sinkhorn_iters"],
            hc_eps=float(cfg["hc_eps"]),
            compress_rope_scaling=rope_scaling(
                (cfg.get("rope_parameters") or {}).get("compress"), source
            ),
        )


FAMILY = DeepseekV4()
