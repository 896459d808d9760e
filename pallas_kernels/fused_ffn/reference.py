"""The gated FFN of Llama in pure JAX: the reference for the Pallas kernel and the CPU path.

T: tokens, E: hidden size, I: intermediate size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fused_ffn_reference(
    x: jax.Array,  # [T, E]
    gate_up: jax.Array,  # [E, 2I]: W_gate then W_up, by columns
    down: jax.Array,  # [I, E]
) -> jax.Array:  # [T, E]
    """down(silu(x @ W_gate) * (x @ W_up))."""
    gate, up = jnp.split(x @ gate_up, 2, axis=-1)  # [T, I] each
    return (jax.nn.silu(gate) * up) @ down
