"""The model's projections in either of two weight layouts.

- "in_out": each weight is [in, *out] and a projection is x @ W. The loader's and checkpoint's
  layout, and the one the Pallas FFN kernel takes (GPU).
- "out_in": each weight is [*out, in] (PyTorch's nn.Linear order) and a projection is computed
  as W @ x^T, then transposed back. On XLA:CPU this is much faster for the few rows of a decode
  step: Eigen's contraction runs the large operand as the left one far better. Measured here
  (float32, 2 cores), the gated FFN of the default model took 0.6 against 1.5 ms at 8 rows and
  1.6 against 3.3 ms at 32 rows, and its LM head 14 against 42 ms at 32 rows.

In "out_in" the transposes of the activations are materialized on their own
(`optimization_barrier`): XLA:CPU otherwise folds a transpose into the dot's operand layout,
which sends the dot down a slow path that loses the whole gain.

E: hidden size, I: intermediate size, V: vocabulary, T: tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IN_OUT = "in_out"
OUT_IN = "out_in"
LAYOUTS = (IN_OUT, OUT_IN)

# For each projection of a decoder layer (without the [L] axis): its "out_in" axes as a
# permutation of its "in_out" axes. The contracted input axis is always first in "in_out".
LAYER_PERMUTATIONS = {
    "qkv_proj": (1, 2, 3, 0),  # [E, K, G + 2, D] -> [K, G + 2, D, E]
    "o_proj": (1, 0),  # [H * D, E] -> [E, H * D]
    "gate_up_proj": (1, 2, 0),  # [E, 2, I] -> [2, I, E]
    "down_proj": (1, 0),  # [I, E] -> [E, I]
}
TOP_PERMUTATIONS = {"lm_head": (1, 0)}  # [E, V] -> [V, E] (a tied head is the [V, E] embedding)


def _permute(tree: dict, permutations: dict, leading: int, fn) -> dict:
    """Applies fn(value, permutation) to the entries that have a permutation; `leading` axes
    (the stacked [L] axis) stay in front."""
    out = dict(tree)
    for name, perm in permutations.items():
        if name in out:
            full = tuple(range(leading)) + tuple(leading + p for p in perm)
            out[name] = fn(out[name], full)
    return out


def to_layout(params: dict, layout: str) -> dict:
    """The loader's parameter tree ("in_out", layers stacked [L, ...]) in `layout`."""
    check_layout(layout)
    if layout == IN_OUT:
        return params
    out = _permute(params, TOP_PERMUTATIONS, 0, lambda a, p: a.transpose(p))
    out["layers"] = _permute(params["layers"], LAYER_PERMUTATIONS, 1, lambda a, p: a.transpose(p))
    return out


def axes_in_layout(axes: dict, layout: str) -> dict:
    """PARAM_AXES (logical axes of the "in_out" tree) for the tree in `layout`."""
    check_layout(layout)
    if layout == IN_OUT:
        return axes

    def reorder(names, perm):
        return tuple(names[i] for i in perm)

    out = _permute(axes, TOP_PERMUTATIONS, 0, reorder)
    out["layers"] = _permute(axes["layers"], LAYER_PERMUTATIONS, 1, reorder)
    return out


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be one of {LAYOUTS}, got {layout!r}")


def _feature_major(x: jax.Array) -> jax.Array:  # [T, in] -> [in, T], materialized
    return jax.lax.optimization_barrier(x.T)


def _token_major(y: jax.Array) -> jax.Array:  # [*out, T] -> [T, *out]
    return jnp.moveaxis(jax.lax.optimization_barrier(y), -1, 0)


def dense(x: jax.Array, w: jax.Array, layout: str) -> jax.Array:
    """x [T, in] times w ([in, *out] or [*out, in]) -> [T, *out]."""
    if layout == IN_OUT:
        return jnp.tensordot(x, w, axes=1)
    return _token_major(jnp.tensordot(w, _feature_major(x), axes=1))


def gated_ffn_out_in(
    x: jax.Array,  # [T, E]
    gate_up: jax.Array,  # [2, I, E]
    down: jax.Array,  # [E, I]
) -> jax.Array:  # [T, E]
    """down(silu(x @ W_gate) * (x @ W_up)) on "out_in" weights, feature-major inside: the
    [I, T] activation is never transposed."""
    h = jnp.einsum("cie,et->cit", gate_up, _feature_major(x))  # [2, I, T]
    act = jax.lax.optimization_barrier(jax.nn.silu(h[0]) * h[1])  # [I, T]
    return _token_major(down @ act)


def lm_logits(x: jax.Array, w: jax.Array, layout: str, tied: bool) -> jax.Array:
    """x [N, E] times the LM head -> [N, V]. w is [V, E] when tied (the embedding) or in
    "out_in", else [E, V]. In "out_in" a vocabulary-major head runs as W @ x^T, except for a
    single row, where the plain matrix-vector product was as fast or faster here."""
    if not tied and layout == IN_OUT:
        return x @ w
    if layout == IN_OUT or x.shape[0] == 1:
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
    return _token_major(w @ _feature_major(x))
