"""Grouped matmul, pure JAX: rows of x sorted by group, each group times its own weight.

    y[r] = x[r] @ w[g(r)]   for the rows r of group g: rows offsets[g] .. offsets[g] + sizes[g]
                            (offsets: the exclusive cumulative sum of group_sizes)

Rows after the last group are zero. This is `jax.lax.ragged_dot`, which XLA:CPU (and a GPU
without a dedicated lowering) computes densely: every row against every group's weight, then
masked, so it is a reference, not a fast path (tools/bench_moe.py measures it).

M: rows, K: the contracted axis, N: outputs, G: groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [G, K, N] (float, or int8 converted to x's dtype)
    group_sizes: jax.Array,  # i32[G], summing to at most M
) -> jax.Array:  # [M, N] in x's dtype
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32))


def grouped_matmul_out_in_reference(
    x: jax.Array,  # [M, K]
    w: jax.Array,  # [G, N, K]: each group's weight with its input axis last
    group_sizes: jax.Array,  # i32[G]
) -> jax.Array:  # [M, N]
    """The same product on weights in the "out_in" layout (jaxinfer.layers.linear)."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), numbers)
