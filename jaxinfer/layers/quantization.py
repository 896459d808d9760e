"""Weight-only int8 quantization with one scale per output channel.

Each projection weight W (and the LM head) is stored as int8 Q with a float32 scale s per
output channel: W ~= Q * s, s = max |W| over the input axis / 127. Activations, norms, the KV
cache and the embedding lookup stay in the model's dtype; a projection computes
(x @ Q.astype(dtype)) * s. The weights are jaxinfer.layers.weights.Int8; quantized in the
loader's "in_out" layout, before they are put in their run-time layout: the scales follow the
output axes, whose order both layouts share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.layers.weights import Dense, Int8


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
    q, scale = quantize_int8(weight.w, axis=weight.input_axis)
    return Int8(q, scale, weight.input_axis)


# EngineOptions.quantization -> what turns a float weight into that format.
QUANTIZERS = {"int8": quantize}
