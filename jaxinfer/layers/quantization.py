"""Weight-only quantization at load: int8 with one scale per output channel, or int4 in
groups along the input axis.

- int8: each projection weight W (and the LM head) is stored as int8 Q with a float32 scale s
  per output channel: W ~= Q * s, s = max |W| over the input axis / 127
  (jaxinfer.layers.weights.Int8). Quantized in the loader's "in_out" layout, before the
  weights are put in their run-time layout: the scales follow the output axes, whose order
  both layouts share.
- int4: groups of 32, 64 or 128 inputs, symmetric or over each group's own range, scale and
  bias stored as float16 (jaxinfer.layers.weights.Int4; the format and its quantizer:
  pallas_kernels.int4_matmul.reference).

Activations, norms, the KV cache and the embedding lookup stay in the model's dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.layers.weights import Dense, Int4, Int8, _moveaxis
from pallas_kernels.int4_matmul import reference as int4_reference

METHODS = ("int8", "int4")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How float weights are quantized at load (EngineOptions.quantization and its options)."""

    method: str  # "int8" or "int4"
    group_size: int = 32  # int4: inputs per group
    symmetric: bool = False  # int4: symmetric groups (else each group's own range)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"quantization must be one of {METHODS}, got {self.method!r}")
        if self.method == "int4" and self.group_size not in int4_reference.GROUP_SIZES:
            raise ValueError(
                f"int4 group size must be one of {int4_reference.GROUP_SIZES}, "
                f"got {self.group_size}"
            )

    def __str__(self) -> str:
        if self.method == "int8":
            return "int8"
        return f"int4 (groups of {self.group_size}{', symmetric' if self.symmetric else ''})"

    @property
    def from_q4_blocks(self) -> bool:
        """Whether a GGUF source's Q4_0 / Q4_1 / Q4_K blocks are this format's weights as they
        are (int4 in asymmetric groups of 32, jaxinfer.model_loader.gguf_blocks)."""
        return self.method == "int4" and self.group_size == 32 and not self.symmetric

    @property
    def head(self) -> Quantization:
        """The LM head's (and tied embedding's) quantization: int8 per output channel under
        int4 too. The logits are the most sensitive product of all (llama.cpp keeps its output
        layer at 6 or 8 bits): on the default model an int4 head moved the top-1 token at 1 in
        10 positions, int4 projections alone at about 1 in 100 (tools/quant_accuracy.py)."""
        return Quantization("int8") if self.method == "int4" else self

    def quantize(self, weight: Dense):
        """A float weight in this format."""
        if self.method == "int8":
            q, scale = quantize_int8(weight.w, axis=weight.input_axis)
            return Int8(q, scale, weight.input_axis)
        w = _moveaxis(np.asarray(weight.w, np.float32), weight.input_axis)
        qs, scale, bias = int4_reference.quantize(w, self.group_size, self.symmetric)
        return Int4(qs, scale, bias, weight.input_axis)


def quantize_int8(w, axis: int):
    """(int8 Q, float32 scale without `axis`) with W ~= Q * scale, per channel over `axis`."""
    xp = jnp if isinstance(w, jax.Array) else np
    w = w.astype(xp.float32)
    scale = xp.max(xp.abs(w), axis=axis, keepdims=True) / 127.0
    scale = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.rint(w / scale), -127, 127).astype(xp.int8)
    return q, xp.squeeze(scale, axis).astype(xp.float32)


def quantize(weight: Dense) -> Int8:
    """A float weight as int8 with per-output-channel scales (over its input axis)."""
    return Quantization("int8").quantize(weight)
