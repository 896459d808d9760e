"""The model families, one module each, and the registry that finds a family by its Hugging
Face architecture (config.json's `architectures`) or its GGUF architecture
(`general.architecture`). Adding a family is one module here and its tests."""

from __future__ import annotations

from jaxinfer.models.families import (
    deepseek_v4,
    gemma3,
    llama,
    mistral,
    mixtral,
    olmoe,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
)
from jaxinfer.models.families.family import GGUFMetadata, ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    tuple(
        module.FAMILY
        for module in (
            llama,
            mistral,
            qwen2,
            qwen3,
            qwen2_moe,
            qwen3_moe,
            mixtral,
            olmoe,
            gemma3,
            deepseek_v4,
        )
    )
    + qwen3_5.FAMILIES
)


def supported_architectures() -> tuple[str, ...]:
    return tuple(arch for family in FAMILIES for arch in family.hf_architectures)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(dict.fromkeys(f.gguf_architecture for f in FAMILIES if f.gguf_architecture))


def family_for_architecture(architecture: str, source: str = "config.json") -> ModelFamily:
    """The family of a Hugging Face architecture name ("Qwen2ForCausalLM")."""
    for family in FAMILIES:
        if architecture in family.hf_architectures:
            return family
    raise ValueError(
        f"{source}: architecture {architecture!r} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )


def family_for_gguf(meta: GGUFMetadata) -> ModelFamily:
    """The family of a GGUF file, by its general.architecture (and what else tells families of
    one architecture apart)."""
    for family in FAMILIES:
        if family.gguf_architecture == meta.architecture and family.matches_gguf(meta):
            return family
    raise ValueError(
        f"{meta.source}: GGUF architecture {meta.architecture!r} is not supported; "
        f"supported: {', '.join(supported_gguf_architectures())}"
    )
