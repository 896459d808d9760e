"""The product of float activations and int8 weights with per-output-channel scales, in pure
JAX: the reference for the C++ kernel (kernel.cc).

T: tokens (rows of x), K: the contracted (input) axis, *out: the weight's output axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def int8_matmul_reference(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [*out, K] int8
    scale: jax.Array,  # [*out]
) -> jax.Array:  # [T, *out]
    """(x @ w^T) * scale, in x's dtype."""
    y = jnp.tensordot(x, w.astype(x.dtype), axes=((1,), (w.ndim - 1,)))
    return y * scale.astype(x.dtype)
