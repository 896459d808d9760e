"""Reads a LoRA adapter saved by PEFT (adapter_config.json + adapter_model.safetensors) into
host arrays the engine's adapter slots take (jaxinfer.engine.lora), checked against the
model: what the slots cannot hold is refused with a clear error, never dropped.

Taken: rank `r` (per module through `rank_pattern`), `lora_alpha` (`alpha_pattern`),
rsLoRA's scaling (alpha / sqrt(r)), target modules among q/k/v/o_proj and gate/up/down_proj
on any subset of layers. Refused: DoRA, modules_to_save, embedding and LM-head adapters
(trainable tokens), LoRA biases, fan_in_fan_out weights, MLP targets of a mixture-of-experts
model, ranks above the engine's max_lora_rank.

L: layers, R: the adapter's largest rank, I and O: a projection's input and output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from jaxinfer.lora_request import LoRARequest

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter's pairs by target module: a [L, R, I] (lora_A) and b [L, R, O] (lora_B
    transposed, times the module's scaling), zeros for layers and ranks it does not have."""

    request: LoRARequest
    rank: int
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (a, b), float32


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module override: the first pattern that ends the module's dotted name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _refusals(config: dict) -> list[str]:
    why = []
    if config.get("peft_type", "LORA") != "LORA":
        why.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        why.append("DoRA (use_dora)")
    if config.get("modules_to_save"):
        why.append(f"modules_to_save {config['modules_to_save']!r}")
    if config.get("trainable_token_indices"):
        why.append("trainable token embeddings (trainable_token_indices)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        why.append("LoRA biases")
    if config.get("fan_in_fan_out"):
        why.append("fan_in_fan_out weights")
    if config.get("layer_replication"):
        why.append("layer_replication")
    if config.get("target_parameters"):
        why.append("target_parameters (adapters of parameters, not modules)")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    embedding = [t for t in targets if t in ("embed_tokens", "lm_head", "wte", "embed_out")]
    if embedding:
        why.append(f"adapters of the embedding or LM head ({', '.join(embedding)})")
    return why


def load_peft_adapter(
    request: LoRARequest,
    shapes: dict[str, tuple[int, int]],  # target -> (I, O) the model's projections take
    num_layers: int,
    max_rank: int,
) -> LoraAdapter:
    """The adapter in `request.path`; ValueError for anything the engine cannot serve."""
    folder = Path(request.path)
    name = f"LoRA adapter {request.name!r} ({folder})"
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{name}: cannot read {CONFIG_FILE}: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{name}: {CONFIG_FILE} is not an object")
    refused = _refusals(config)
    if refused:
        raise ValueError(f"{name} uses what jaxinfer does not serve: {'; '.join(refused)}")
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{name}: no {WEIGHTS_FILE} (a .bin adapter must be saved as safetensors)")
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except Exception as error:  # (safetensors raises its own error types)
        raise ValueError(f"{name}: cannot read {WEIGHTS_FILE}: {error}") from None
    found: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{name}: tensor {key!r} is not a LoRA pair of a layer's projection")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in shapes:
            served = ", ".join(shapes)
            raise ValueError(f"{name}: target {module!r} is not served for this model ({served})")
        if layer >= num_layers:
            raise ValueError(f"{name}: layer {layer} is beyond the model's {num_layers}")
        found.setdefault((module, layer), {})[side] = np.asarray(value, np.float32)
    if not found:
        raise ValueError(f"{name}: {WEIGHTS_FILE} holds no LoRA pairs")
    alpha = config.get("lora_alpha", 8)
    ranks = {}
    for (module, layer), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{name}: {module} of layer {layer} lacks lora_A or lora_B")
        a, b = pair["A"], pair["B"]  # [r, I], [O, r]
        inputs, outputs = shapes[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != inputs or b.shape != (outputs, a.shape[0]):
            raise ValueError(
                f"{name}: {module} of layer {layer} has lora_A {a.shape} and lora_B {b.shape}; "
                f"the model's takes [r, {inputs}] and [{outputs}, r]"
            )
        ranks[module, layer] = a.shape[0]
    largest = max(ranks.values())
    if largest > max_rank:
        raise ValueError(f"{name} has rank {largest}, above the engine's max_lora_rank {max_rank}")
    pairs = {}
    for module in sorted({m for m, _ in found}, key=list(shapes).index):
        inputs, outputs = shapes[module]
        a_all = np.zeros((num_layers, largest, inputs), np.float32)
        b_all = np.zeros((num_layers, largest, outputs), np.float32)
        for (target, layer), pair in found.items():
            if target != module:
                continue
            path = f"model.layers.{layer}.{module}"
            r = ranks[module, layer]  # (its tensors' own: r, or rank_pattern's)
            module_alpha = _pattern_value(config.get("alpha_pattern"), path, alpha)
            scale = module_alpha / (math.sqrt(r) if config.get("use_rslora") else r)
            a_all[layer, :r] = pair["A"]
            b_all[layer, :r] = pair["B"].T * np.float32(scale)
        pairs[module] = (a_all, b_all)
    return LoraAdapter(request, largest, pairs)
