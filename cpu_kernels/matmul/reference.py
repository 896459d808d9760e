"""The product of float activations and "out_in" weights (float, or int8 with one scale per
output channel) in pure JAX: the reference for the C++ kernel (kernel.cc).

T: tokens (rows of x), K: the contracted (input) axis, *out: the weight's output axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_reference(
    x: jax.Array,  # [T, K]
    w: jax.Array,  # [*out, K], float or int8
    scale: jax.Array | None = None,  # [*out] for int8 w
) -> jax.Array:  # [T, *out]
    """(x @ w^T) (* scale), in x's dtype."""
    y = jnp.tensordot(x, w.astype(x.dtype), axes=((1,), (w.ndim - 1,)))
    return y if scale is None else y * scale.astype(x.dtype)
