"""What a model family declares, and the defaults most families share: the Llama decoder's
weight names in safetensors and in GGUF, and how a GGUF file's metadata becomes a config.json.

A family is one module of this package holding one ModelFamily: the Hugging Face
architectures and the GGUF architecture it handles, how its config.json maps onto the shared
decoder's config (jaxinfer.arch_config.LlamaConfig: biases, q/k norms, windows, experts,
...), its weight names, and the GGUF tokenizer models its files come with. The registry
(jaxinfer.models.families) finds a family by either architecture name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxinfer.arch_config import RopeScaling

# GGUF tensor names (llama.cpp's) -> Hugging Face's, shared by the Llama-style families.
GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, the experts packed [X, ...], the shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # joined with up into mlp.experts.gate_up_proj
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


class GGUFMetadata:
    """A GGUF file's metadata values by key, read for one architecture: `arch("block_count")`
    is `{architecture}.block_count`."""

    def __init__(self, values: dict[str, Any], source: str):
        self.values, self.source = values, source
        self.architecture = self.require("general.architecture")

    def get(self, key: str, default=None):
        value = self.values.get(key)
        return default if value is None else value

    def require(self, key: str):
        value = self.values.get(key)
        if value is None:
            raise ValueError(f"{self.source}: GGUF metadata has no {key!r}")
        return value

    def arch(self, key: str, default=None):
        return self.get(f"{self.architecture}.{key}", default)

    def arch_require(self, key: str):
        return self.require(f"{self.architecture}.{key}")


class ModelFamily:
    """The declarations of one family; subclasses override what differs."""

    name: str = ""
    hf_architectures: tuple[str, ...] = ()
    gguf_architecture: str | None = None  # llama.cpp's name, None: no GGUF form
    gguf_tokenizers: tuple[str, ...] = ("gpt2",)  # tokenizer.ggml.model values its files use
    # llama.cpp's converter interleaves each head's rotary halves in Q and K (its "llama"
    # architecture only); the GGUF reader undoes it.
    gguf_qk_permuted: bool = False
    # Per-expert tensor names in safetensors (the layout of older transformers): the MoE
    # block's prefix, then the gate, up and down projections' names.
    expert_names: tuple[str, tuple[str, str, str]] = ("mlp.", ("gate_proj", "up_proj", "down_proj"))
    # A layer's norms: the model's parameter -> the checkpoint's name in the layer. Llama's
    # post_attention_layernorm is the norm before the FFN.
    layer_norms: dict[str, str] = {  # noqa: RUF012 (read only)
        "input_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
    }

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's own LlamaConfig fields from its config.json (the shared ones are read
        by jaxinfer.models.families.hf_config); a ValueError for what it cannot run. This
        default: the shared decoder as it is (SiLU, one attention type for every layer)."""
        refuse_activation(cfg, source)
        refuse_layer_types(cfg, source)
        return {}

    def matches_gguf(self, meta: GGUFMetadata) -> bool:
        """Whether a file of this family's GGUF architecture is this family's (llama.cpp's
        "llama" is Llama, or Mixtral with experts)."""
        return True

    def hf_config_from_gguf(self, meta: GGUFMetadata) -> dict[str, Any]:
        """The config.json of a GGUF file of this family (the tokenizer's fields aside)."""
        heads = int(meta.arch_require("attention.head_count"))
        hidden = int(meta.arch_require("embedding_length"))
        head_dim = meta.arch("attention.key_length") or meta.arch("rope.dimension_count")
        return {
            "architectures": [self.hf_architectures[0]],
            "model_type": self.name,
            "hidden_size": hidden,
            "intermediate_size": int(meta.arch("feed_forward_length", 0)),
            "num_hidden_layers": int(meta.arch_require("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(meta.arch("attention.head_count_kv", heads)),
            "head_dim": int(head_dim or hidden // heads),
            "rms_norm_eps": float(meta.arch_require("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(meta.arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(meta.arch_require("context_length")),
            "hidden_act": "silu",
            "torch_dtype": "float32",
            **_rope_scaling_from_gguf(meta),
        }

    def hf_tensor_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor ("blk.3.attn_q.bias" ->
        "model.layers.3.self_attn.q_proj.bias"), None if the family has no such tensor."""
        base, _, kind = gguf_name.rpartition(".")
        if kind not in ("weight", "bias"):
            return None
        if base in GGUF_GLOBAL_TENSORS:
            return f"{GGUF_GLOBAL_TENSORS[base]}.{kind}"
        parts = base.split(".")
        layer_tensors = {**GGUF_LAYER_TENSORS, **self.gguf_layer_tensors()}
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
            return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
        return None

    def gguf_layer_tensors(self) -> dict[str, str]:
        """GGUF layer tensor names of this family beyond (or instead of) the shared ones."""
        return {}

    def hf_tensor_from_gguf(self, hf_name: str, value: np.ndarray) -> np.ndarray:
        """A GGUF tensor's value as Hugging Face stores it (Gemma's norms are w + 1 in GGUF)."""
        return value


def refuse_activation(cfg: dict[str, Any], source: str, supported: str = "silu") -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", supported))
    if act != supported:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported ({supported})")


def refuse_layer_types(cfg: dict[str, Any], source: str) -> None:
    if cfg.get("layer_types") and len(set(cfg["layer_types"])) > 1:
        raise ValueError(
            f"{source}: layers of different attention types ({sorted(set(cfg['layer_types']))})"
            " are not supported"
        )


def _yarn(scaling: dict[str, Any], source: str) -> RopeScaling:
    """YaRN as transformers reads it (its attention factor: given, from mscale and
    mscale_all_dim, or 0.1 ln(factor) + 1)."""
    if scaling.get("truncate") is False:
        raise ValueError(f"{source}: YaRN without truncate is not supported")
    if not scaling.get("original_max_position_embeddings") or not scaling.get("factor"):
        raise ValueError(f"{source}: YaRN needs factor and original_max_position_embeddings")
    factor = float(scaling["factor"])

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = (
            mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]) if both else mscale(1.0)
        )
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        attention_factor=float(attention),
    )


def _rope_scaling_from_gguf(meta: GGUFMetadata) -> dict[str, Any]:
    kind = meta.arch("rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": meta.arch("rope.scaling.factor")}}
    raise ValueError(f"{meta.source}: GGUF rope scaling {kind!r} is not supported (linear)")


def rope_scaling(scaling: dict[str, Any] | None, source: str) -> RopeScaling | None:
    """A config's rope_scaling (or rope_parameters), None for the default RoPE."""
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
    if rope_type == "yarn":
        return _yarn(scaling, source)
    raise ValueError(f"{source}: rope_scaling type {rope_type!r} is not supported")
