"""Weight-only int8 quantization with one scale per output channel.

Each projection weight W (and the LM head) is stored as int8 Q with a float32 scale s per
output channel: W ~= Q * s, s = max |W| over the input axis / 127. Activations, norms, the KV
cache and the embedding lookup stay in the model's dtype; a projection computes
(x @ Q.astype(dtype)) * s. Quantized in the loader's "in_out" layout, before the weights are put
in their run-time layout (jaxinfer.layers.linear): the scales follow the output axes, whose
order both layouts share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = ("int8",)
LAYER_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # input axis 1 (after L)
SCALE = "_scale"  # the scale of parameter `name` is `name + SCALE`

# Logical axes of each scale (its weight's axes without the input axis).
SCALE_AXES = {
    "embed_scale": ("vocab",),
    "lm_head_scale": ("vocab",),
    "layers": {
        "qkv_proj_scale": ("layers", "kv_heads", "qkv", "head_dim"),
        "o_proj_scale": ("layers", "embed"),
        "gate_up_proj_scale": ("layers", "gate_up", "mlp"),
        "down_proj_scale": ("layers", "embed"),
    },
}


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )


def quantize_int8(w, axis: int):
    """(int8 Q, float32 scale without `axis`) with W ~= Q * scale, per channel over `axis`."""
    xp = jnp if isinstance(w, jax.Array) else np
    w = w.astype(xp.float32)
    scale = xp.max(xp.abs(w), axis=axis, keepdims=True) / 127.0
    scale = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.rint(w / scale), -127, 127).astype(xp.int8)
    return q, xp.squeeze(scale, axis).astype(xp.float32)


def quantize_params(params: dict, tied: bool) -> dict:
    """The loader's tree ("in_out", layers stacked) with every projection and the LM head
    (the embedding when tied) in int8, plus their scales."""
    out = dict(params)
    layers = dict(params["layers"])
    for name in LAYER_WEIGHTS:
        layers[name], layers[name + SCALE] = quantize_int8(layers[name], axis=1)
    out["layers"] = layers
    if tied:  # [V, E]: the LM head contracts E; the lookup rescales its rows
        out["embed"], out["embed" + SCALE] = quantize_int8(params["embed"], axis=1)
    else:  # [E, V]
        out["lm_head"], out["lm_head" + SCALE] = quantize_int8(params["lm_head"], axis=0)
    return out


def dequantize_rows(table: jax.Array, scale: jax.Array | None, ids: jax.Array, dtype):
    """Rows `ids` of an embedding table [V, E] (int8 with per-row scales, or plain)."""
    rows = table[ids]
    if scale is None:
        return rows
    return rows.astype(dtype) * scale[ids][:, None].astype(dtype)


def dequantize(w: jax.Array, scale: jax.Array | None, dtype, input_axis: int = 0) -> jax.Array:
    """The float weight (for kernels that take float weights); `input_axis` is the axis the
    scale does not cover."""
    if scale is None:
        return w
    return w.astype(dtype) * jnp.expand_dims(scale, input_axis).astype(dtype)
