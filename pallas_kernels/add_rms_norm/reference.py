"""Residual add followed by RMSNorm, in pure JAX: the reference for the Pallas kernel.

T: tokens, E: hidden size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:  # [..., E]
    """x / rms(x) * weight, computed in float32."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def add_rms_norm_reference(
    x: jax.Array,  # [T, E], a sublayer's output
    residual: jax.Array,  # [T, E], the residual stream
    weight: jax.Array,  # [E]
    *,
    eps: float,
) -> tuple[jax.Array, jax.Array]:  # (normed [T, E], new residual x + residual [T, E])
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
