"""y = x @ w in pure JAX: the reference for the Pallas matmul.

T: rows of x, K: the contracted axis, N: columns of w.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:  # [T, K] @ [K, N] -> [T, N]
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
