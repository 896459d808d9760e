"""Projection weights kept a second time as the GGUF file's own blocks (Q4_1, Q8_0), exactly
equal to the float32 weights once dequantized (jaxinfer.model_loader.gguf_blocks), for the
kernel that multiplies them directly (cpu_kernels.gguf_matmul): a decode step of a few tokens
reads a quarter of the bytes, with bit-identical products.

Next to a weight `name` in the parameter tree: `name + QS` (the quantized values) and
`name + SCALES` (float32 scales), both "out_in" ([L, N, ...] for the layers, [V, ...] for the
head); replicated (the kernel runs on one device).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.layers.quantization import LAYER_WEIGHTS

QS, SCALES = "_gguf_qs", "_gguf_scales"
HEAD_WEIGHTS = ("embed", "lm_head")  # the LM head: the embedding when tied

# Logical axes of the block arrays: none (replicated).
AXES = {
    "layers": {name + suffix: () for name in LAYER_WEIGHTS for suffix in (QS, SCALES)},
    **{name + suffix: () for name in HEAD_WEIGHTS for suffix in (QS, SCALES)},
}


def is_block_param(name: str) -> bool:
    return name.endswith((QS, SCALES))


def blocks_of(params: dict, name: str):
    """(qs, scales) of weight `name` in `params`, or None where it has no blocks."""
    if name + QS not in params:
        return None
    return params[name + QS], params[name + SCALES]


def block_format(qs) -> str:
    """ "Q8_0" for int8 values, "Q4_1" for packed nibbles (uint8)."""
    return "Q8_0" if jnp.dtype(qs.dtype) == jnp.int8 else "Q4_1"


def block_tree(blocks: dict) -> dict:
    """The parameter entries of `blocks` ({"layers": {name: BlockWeight}, "embed": ...})."""
    out: dict = {"layers": {}}
    for name, w in blocks.get("layers", {}).items():
        out["layers"][name + QS], out["layers"][name + SCALES] = w.qs, w.scales
    for name in HEAD_WEIGHTS:
        if name in blocks:
            out[name + QS], out[name + SCALES] = blocks[name].qs, blocks[name].scales
    return out
