"""The architecture of a Llama-family checkpoint, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# The Llama block and its variants: a QKV bias (Qwen2, Qwen2-MoE), per-head q/k norms (Qwen3,
# Qwen3-MoE), q/k norms over all heads and a QKV clip (OLMoE), a sliding window (Mistral,
# Mixtral), and a mixture-of-experts FFN (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE). Anything else
# is refused.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
)
MOE_ARCHITECTURES = (
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
)
QK_NORMS = {"Qwen3ForCausalLM": "head", "Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "all"}


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How a token's experts and their weights are chosen (jaxinfer.layers.moe.routing): the
    union of what Mixtral, Qwen-MoE, OLMoE and DeepSeek-V3 do."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" or "sigmoid" of the router logits
    renormalize: bool = False  # the top-k weights divided by their sum (norm_topk_prob)
    scaling_factor: float = 1.0  # routed_scaling_factor, applied after renormalizing
    correction_bias: bool = False  # e_score_correction_bias: added for the choice only
    num_groups: int = 1  # grouped top-k: experts in n_group groups ...
    topk_groups: int = 1  # ... of which the topk_group best (by their top-2 sum) are eligible

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be softmax or sigmoid, got {self.scoring!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, {self.num_experts}]")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts cannot form {self.num_groups} groups of which "
                f"{self.topk_groups} are chosen"
            )


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts FFN in every layer: routed experts, and optionally a shared
    expert beside them (the dense FFN of intermediate_size, gated by a sigmoid in Qwen2-MoE)."""

    router: RouterConfig
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k


# quantization_config methods whose checkpoints load as they are (4-bit weights in groups).
CHECKPOINT_QUANTIZATIONS = ("awq", "gptq")


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint saved with 4-bit weights (config.json's quantization_config), loaded as
    jaxinfer.layers.weights.Int4 (jaxinfer.model_loader.quantized_checkpoint)."""

    method: str  # "awq" or "gptq"
    group_size: int
    # GPTQ's checkpoint_format "gptq" (v1) stores each zero point minus one; "gptq_v2" does not.
    zeros_minus_one: bool = False

    def __str__(self) -> str:
        return f"{self.method} int4 (groups of {self.group_size})"


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


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_scaling.rope_type == "llama3"`) or linear scaling."""

    rope_type: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters; names follow Hugging Face's LlamaConfig."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # QKV bias (Qwen2 always has one)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: over each "head", or "all"
    clip_qkv: float | None = None  # q, k and v clipped to [-c, c] (OLMoE)
    sliding_window: int | None = None  # each token sees itself and the W - 1 tokens before
    moe: MoeConfig | None = None  # every layer's FFN is a mixture of experts
    quantization: CheckpointQuantization | None = None  # saved with 4-bit weights (AWQ, GPTQ)

    @property
    def dense_intermediate_size(self) -> int:
        """The dense FFN's width (a MoE model's shared expert, 0 without one)."""
        if self.moe is None:
            return self.intermediate_size
        return self.moe.shared_intermediate_size

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> LlamaConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
            raise ValueError(
                f"{source}: Qwen's sliding window (on layers from max_window_layers) is not "
                "supported"
            )
        if cfg.get("layer_types") and len(set(cfg["layer_types"])) > 1:
            raise ValueError(
                f"{source}: layers of different attention types ({sorted(set(cfg['layer_types']))})"
                " are not supported"
            )
        sliding_window = None
        if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            sliding_window = cfg.get("sliding_window") or None
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in cfg:
                raise ValueError(f"{source}: missing required field {key!r}")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
            or cfg.get("attention_bias", False),
            rope_scaling=_rope_scaling(cfg, source),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=QK_NORMS.get(arch),
            clip_qkv=cfg.get("clip_qkv") if arch == "OlmoeForCausalLM" else None,
            sliding_window=sliding_window,
            moe=_moe_config(arch, cfg, source),
            quantization=_checkpoint_quantization(cfg, source),
        )

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        try:
            cfg = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(cfg, source=str(path))


def _moe_config(arch: str, cfg: dict[str, Any], source: str) -> MoeConfig | None:
    """The MoE FFN of a MoE architecture (every field its HF implementation reads), or None."""
    if arch not in MOE_ARCHITECTURES:
        return None
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{source}: dense layers between MoE layers (mlp_only_layers, decoder_sparse_step) "
            "are not supported: every layer must be a MoE layer"
        )
    # transformers writes num_local_experts (recent versions) or num_experts
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not num_experts:
        raise ValueError(f"{source}: a MoE config needs num_local_experts or num_experts")
    if arch == "MixtralForCausalLM":
        renormalize = True  # Mixtral always renormalizes its top-k
        intermediate = cfg["intermediate_size"]
    else:
        renormalize = bool(cfg.get("norm_topk_prob"))
        intermediate = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    top_k = cfg.get("num_experts_per_tok", 2 if arch == "MixtralForCausalLM" else 8)
    if arch == "OlmoeForCausalLM":
        intermediate = cfg["intermediate_size"]
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = cfg.get("shared_expert_intermediate_size", 0)
        if not shared:
            raise ValueError(f"{source}: Qwen2-MoE needs shared_expert_intermediate_size")
    return MoeConfig(
        router=RouterConfig(num_experts=num_experts, top_k=top_k, renormalize=renormalize),
        intermediate_size=intermediate,
        shared_intermediate_size=shared,
        shared_expert_gate=arch == "Qwen2MoeForCausalLM",
    )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any], source: str) -> RopeScaling | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(scaling["factor"]))
    raise ValueError(f"{source}: rope_scaling type {rope_type!r} is not supported")
