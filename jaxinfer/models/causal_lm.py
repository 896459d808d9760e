"""The model class of an architecture: the Llama decoder, the hybrid one, or DeepSeek-V4's."""

from __future__ import annotations

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.qwen3_5 import HybridForCausalLM


def causal_lm(config: LlamaConfig) -> type[LlamaForCausalLM]:
    if config.compressed is not None:
        return DeepseekV4ForCausalLM
    return LlamaForCausalLM if config.hybrid is None else HybridForCausalLM
