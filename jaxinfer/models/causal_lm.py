"""The model class of an architecture: the Llama decoder, or the hybrid one."""

from __future__ import annotations

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.qwen3_5 import HybridForCausalLM


def causal_lm(config: LlamaConfig) -> type[LlamaForCausalLM]:
    return LlamaForCausalLM if config.hybrid is None else HybridForCausalLM
