"""Llama (LlamaForCausalLM; llama.cpp's "llama" GGUF architecture without experts): the
shared decoder as it is, an optional QKV bias (attention_bias)."""

from __future__ import annotations

from jaxinfer.models.families.family import GGUFMetadata, ModelFamily


class Llama(ModelFamily):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM",)
    gguf_architecture = "llama"
    gguf_qk_permuted = True

    def matches_gguf(self, meta: GGUFMetadata) -> bool:
        return not meta.arch("expert_count")


FAMILY = Llama()
