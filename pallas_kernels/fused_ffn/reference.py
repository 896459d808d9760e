"""The gated FFN of Llama in pure JAX: the reference for the Pallas kernel and the CPU path.

T: tokens, E: hidden size, I: intermediate size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fused_ffn_reference(
    x: jax.Array,  # [T, E]
    gate_up: jax.Array,  # [E, 2, I]: W_gate and W_up stacked (split over devices along I)
    down: jax.Array,  # [I, E]
) -> jax.Array:  # [T, E]
    """down(silu(x @ W_gate) * (x @ W_up))."""
    h = jnp.einsum("te,eci->tci", x, gate_up)  # [T, 2, I]
    return (jax.nn.silu(h[:, 0]) * h[:, 1]) @ down
