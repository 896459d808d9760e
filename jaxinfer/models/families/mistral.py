"""Mistral (MistralForCausalLM): Llama with a sliding window on every layer. llama.cpp writes
Mistral's GGUF files as "llama" (and runs them without the window), so they load as Llama."""

from __future__ import annotations

from typing import Any

from jaxinfer.models.families.family import ModelFamily


class Mistral(ModelFamily):
    name = "mistral"
    hf_architectures = ("MistralForCausalLM",)

    def config_fields(self, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        return {**super().config_fields(cfg, source), **sliding_window(cfg)}


def sliding_window(cfg: dict[str, Any]) -> dict[str, Any]:
    """Each token sees itself and the W - 1 before it (every layer), or no window."""
    return {"sliding_window": cfg.get("sliding_window") or None}


FAMILY = Mistral()
