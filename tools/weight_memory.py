"""Resident weight memory per weight format: float32, int8 and int4 (groups of 32, 64, 128).

The default model is loaded from its folder; an 8B-shaped model (Llama 3 8B's shapes, random
weights) is measured on one decoder layer and its embedding and head, the layer's bytes counted
once per layer (every layer has the same arrays). Bytes are those of the model's placed arrays
(the RoPE table aside), as the engine holds them.

    python -m tools.weight_memory
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import app
from flax import nnx

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.options import EngineOptions
from jaxinfer.layers.linear import OUT_IN
from jaxinfer.layers.quantization import Quantization
from jaxinfer.model_loader.model_cache import resolve_model
from jaxinfer.model_loader.safetensors_loader import load_llama_params
from jaxinfer.models.families.hf_config import read_config
from jaxinfer.models.llama import build_llama
from jaxinfer.models.params import random_params
from jaxinfer.models.shapes import shape

FORMATS = {
    "float32": None,
    "int8": Quantization("int8"),
    "int4 g32": Quantization("int4", 32),
    "int4 g64": Quantization("int4", 64),
    "int4 g128": Quantization("int4", 128),
}


def resident_bytes(config: LlamaConfig, params: dict, quantization) -> tuple[int, int]:
    """(bytes of the decoder layers, bytes of the rest) of the built model."""
    _, state = build_llama(config, params, np.float32, None, OUT_IN, quantization)
    tree = nnx.to_pure_dict(state)
    tree.pop("rope_cache")
    layers = sum(a.nbytes for a in jax.tree.leaves(tree.pop("layers")))
    return layers, sum(a.nbytes for a in jax.tree.leaves(tree))


def main(argv):
    del argv
    folder = resolve_model(None, EngineOptions().cache_dir)
    default = read_config(folder / "config.json")
    big = shape("llama3_8b")
    one_layer = dataclasses.replace(big, num_hidden_layers=1)
    models = [
        ("SmolLM2-135M (default)", default, load_llama_params(folder, default, np.float32), 1),
        ("8B-shaped (Llama 3 8B)", one_layer, random_params(one_layer, np.float32), 32),
    ]
    print("| model | format | weights | / float32 |")
    print("| --- | --- | --- | --- |")
    for name, config, params, layer_count in models:
        float32 = None
        for fmt, quantization in FORMATS.items():
            try:
                layers, rest = resident_bytes(config, params, quantization)
            except ValueError as error:  # groups that do not tile an input axis
                print(f"| {name} | {fmt} | ({error}) | |", flush=True)
                continue
            total = layers * layer_count + rest
            float32 = float32 or total
            print(f"| {name} | {fmt} | {total / 1e9:.3f} GB | {total / float32:.3f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
