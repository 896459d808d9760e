"""A model's config (jaxinfer.arch_config.LlamaConfig) from a Hugging Face config.json: the
fields every family shares, read here, and the family's own (its config_fields)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxinfer.arch_config import (
    CHECKPOINT_QUANTIZATIONS,
    CheckpointQuantization,
    LlamaConfig,
)
from jaxinfer.models.families import family_for_architecture
from jaxinfer.models.families.family import rope_scaling


def read_config(path: Path) -> LlamaConfig:
    """The config of a config.json file."""
    try:
        cfg = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: config.json not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return config_from_dict(cfg, source=str(path))


def config_from_dict(cfg: dict[str, Any], source: str = "config.json") -> LlamaConfig:
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = archs[0]
    family = family_for_architecture(arch, source)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"{source}: missing required field {key!r}")
    fields = family.config_fields(cfg, source)
    if "intermediate_size" not in cfg and "intermediate_size" not in fields:
        raise ValueError(f"{source}: missing required field 'intermediate_size'")
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    shared = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size", 0),
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", False),
        rope_scaling=rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters"), source),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        quantization=_checkpoint_quantization(cfg, source),
    )
    return LlamaConfig(**{**shared, **fields})


def _checkpoint_quantization(cfg: dict[str, Any], source: str) -> CheckpointQuantization | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "?")).lower()
    if method not in CHECKPOINT_QUANTIZATIONS:
        raise ValueError(
            f"{source}: quantization_config quant_method {method!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_QUANTIZATIONS)} (4-bit)"
        )
    bits, size = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{source}: {method} with {bits}-bit weights is not supported (4 only)")
    if not isinstance(size, int) or size <= 0 or size % 32:
        raise ValueError(
            f"{source}: {method} group_size {size!r} is not supported (a multiple of 32; "
            "per-channel scales, group_size -1, are not)"
        )
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{source}: AWQ version {q.get('version')!r} is not supported (gemm)")
    if method == "awq" and not q.get("zero_point", True):
        raise ValueError(f"{source}: AWQ without zero points is not supported")
    if method == "gptq" and q.get("desc_act"):
        raise ValueError(
            f"{source}: GPTQ with desc_act (act-order: groups out of input order, g_idx) is "
            "not supported; quantize with desc_act=false"
        )
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported")
    return CheckpointQuantization(method, size, zeros_minus_one=method == "gptq" and fmt == "gptq")


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
