"""Row reductions whose result for a row depends on that row alone: the batch-invariant mode's
norms, softmaxes and scans (EngineOptions.batch_invariant).

XLA's own reductions (jnp.sum, jnp.mean, jax.nn.logsumexp, jnp.cumsum) choose their loop
blocking and vectorization from the whole array's shape, so one row's float sum can change in
its last bits with the number of rows beside it (XLA:CPU's row sums over [T, 576] did, for
T = 9, 31, 64, ...). Here every sum is a fixed tree of elementwise adds: the halves of the row
added pairwise until one value is left, the tree depending only on the row's length. An
elementwise add is exact IEEE arithmetic on two numbers, so the result cannot depend on the
other rows, the bucket, or how XLA tiles the loop. Max, min and sorts need nothing: they are
exact in any order.

T: rows, N: the reduced axis (last).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array) -> jax.Array:  # [..., N] -> [...]
    """The sum over the last axis by pairwise halves (an odd length gets a zero appended)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def cumsum(x: jax.Array) -> jax.Array:  # [..., N] -> [..., N]
    """The inclusive prefix sum over the last axis, by log2(N) rounds of shifted adds."""
    n, shift = x.shape[-1], 1
    while shift < n:
        shifted = jnp.concatenate([jnp.zeros_like(x[..., :shift]), x[..., :-shift]], axis=-1)
        x = x + shifted
        shift *= 2
    return x


def logsumexp(x: jax.Array, keepdims: bool = False) -> jax.Array:  # [..., N] -> [...]
    """log(sum(exp(x))) over the last axis; -inf for a row of -infs."""
    top = jnp.max(x, axis=-1, keepdims=True)
    finite = jnp.where(jnp.isfinite(top), top, 0.0)
    out = jnp.log(tree_sum(jnp.exp(x - finite))) + finite[..., 0]
    return out[..., None] if keepdims else out


def log_softmax(x: jax.Array) -> jax.Array:  # [..., N]
    return x - logsumexp(x, keepdims=True)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:  # [..., E]
    """x / rms(x) * weight, computed in float32 (pallas_kernels/add_rms_norm/reference.py's
    arithmetic with a tree for the mean of squares)."""
    x32 = x.astype(jnp.float32)
    mean_square = tree_sum(x32 * x32)[..., None] / x.shape[-1]
    x32 = x32 * jax.lax.rsqrt(mean_square + eps)
    return weight * x32.astype(x.dtype)


def add_rms_norm(
    x: jax.Array,  # [T, E]
    residual: jax.Array,  # [T, E]
    weight: jax.Array,  # [E]
    *,
    eps: float,
) -> tuple[jax.Array, jax.Array]:  # (normed [T, E], x + residual [T, E])
    """The "norm" kernel kind's contract (add_rms_norm_reference), one row per reduction."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
