"""The gated FFN of Llama in pure JAX: the reference for the Pallas kernel and the CPU path.

T: tokens, E: hidden size, I: intermediate size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The gate's activation by the name models give it: Llama's SiLU, Gemma's GELU with the tanh
# approximation (HF's gelu_pytorch_tanh).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def fused_ffn_reference(
    x: jax.Array,  # [T, E]
    gate_up: jax.Array,  # [E, 2, I]: W_gate and W_up stacked (split over devices along I)
    down: jax.Array,  # [I, E]
    *,
    activation: str = "silu",
) -> jax.Array:  # [T, E]
    """down(act(x @ W_gate) * (x @ W_up))."""
    h = jnp.einsum("te,eci->tci", x, gate_up)  # [T, 2, I]
    return (ACTIVATIONS[activation](h[:, 0]) * h[:, 1]) @ down
