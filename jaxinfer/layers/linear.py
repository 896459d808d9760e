"""The model's projections in either of two weight layouts.

- "in_out": each weight is [in, *out] and a projection is x @ W. The loader's and checkpoint's
  layout, and the one the Pallas FFN kernel takes (GPU).
- "out_in": each weight is [*out, in] (PyTorch's nn.Linear order) and a projection is computed
  as W @ x^T, then transposed back. On XLA:CPU this is much faster for the few rows of a decode
  step: Eigen's contraction runs the large operand as the left one far better (no gain at one
  row, nor at prefill sizes; tools/bench_cpu_matmul.py measures it).

In "out_in" the transposes of the activations are materialized on their own
(`optimization_barrier`): XLA:CPU otherwise folds a transpose into the dot's operand layout,
which sends the dot down a slow path that loses the whole gain.

E: hidden size, I: intermediate size, V: vocabulary, T: tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.fused_ffn.reference import ACTIVATIONS

IN_OUT = "in_out"
OUT_IN = "out_in"
LAYOUTS = (IN_OUT, OUT_IN)


@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """Layer `layer` of a projection stacked over the layers ([L, ...]), as a layer scan hands
    it to a `matmul` kernel, which reads it in place: slicing it (`get`) makes XLA copy the
    weight every layer, which for the default model's float32 layers is 0.5 GB a step."""

    stacked: jax.Array  # [L, *weight]
    layer: jax.Array  # i32[]

    def get(self) -> jax.Array:
        return self.stacked[self.layer]


def unstacked(w):
    """w itself, or the layer a StackedWeight names (sliced)."""
    return w.get() if isinstance(w, StackedWeight) else w


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout must be one of {LAYOUTS}, got {layout!r}")


def _feature_major(x: jax.Array) -> jax.Array:  # [T, in] -> [in, T], materialized
    return jax.lax.optimization_barrier(x.T)


def _token_major(y: jax.Array) -> jax.Array:  # [*out, T] -> [T, *out]
    return jnp.moveaxis(jax.lax.optimization_barrier(y), -1, 0)


def _as(w: jax.Array, dtype) -> jax.Array:
    """An int8 weight converted inside the consuming dot (XLA fuses the convert; at the sizes
    of one layer's weights that ran as fast as the float weight here)."""
    return w.astype(dtype) if w.dtype == jnp.int8 else w


def _int8_row(x: jax.Array, w: jax.Array) -> jax.Array:
    """One row x [in] times an int8 "out_in" w [*out, in] -> [*out], as a multiply and a sum
    over the input axis: XLA:CPU runs the convert fused into a dot much slower than the float
    matrix-vector product for one row, this about as fast."""
    return jnp.sum(w.astype(x.dtype) * x, axis=-1)


def _int8_one_row(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """x [1, in] times int8 "out_in" w [*out, in] with scales [*out] -> [1, *out]."""
    return (_int8_row(x[0], w) * scale.astype(x.dtype))[None]


def xla_dense(x: jax.Array, w: jax.Array, layout: str, scale: jax.Array | None = None):
    """x [T, in] times w ([in, *out] or [*out, in]) -> [T, *out] with XLA's ops; `scale`
    [*out] for an int8 w (jaxinfer.layers.quantization)."""
    w = unstacked(w)
    if layout == OUT_IN and scale is not None and x.shape[0] == 1:
        return _int8_one_row(x, w, scale)
    w = _as(w, x.dtype)
    if layout == IN_OUT:
        y = jnp.tensordot(x, w, axes=1)
        return y if scale is None else y * scale.astype(y.dtype)
    y = jax.lax.optimization_barrier(jnp.tensordot(w, _feature_major(x), axes=1))  # [*out, T]
    if scale is not None:
        y = y * scale[..., None].astype(y.dtype)
    return jnp.moveaxis(y, -1, 0)


def gated_ffn_projected(
    x: jax.Array, gate_up, down, kernels, activation: str = "silu"
) -> jax.Array:
    """down(act(x @ W_gate) * (x @ W_up)) -> [T, E], each product through its weight's own
    `project` (jaxinfer.layers.weights) with the model's `kernels`, token-major."""
    h = gate_up.project(x, kernels)  # [T, 2, I]
    return down.project(ACTIVATIONS[activation](h[:, 0]) * h[:, 1], kernels)


def gated_ffn_out_in(x: jax.Array, gate_up, down, activation: str = "silu") -> jax.Array:
    """down(act(x @ W_gate) * (x @ W_up)) on "out_in" weights (jaxinfer.layers.weights:
    gate_up [2, I, E], down [E, I]) with XLA's ops -> [T, E], feature-major inside: the
    [I, T] activation is never transposed."""
    (gate_up, gate_up_scale), (down, down_scale) = gate_up.scaled(), down.scaled()
    gate_up, down = unstacked(gate_up), unstacked(down)
    if gate_up_scale is not None and x.shape[0] == 1:
        h = _int8_row(x[0], gate_up) * gate_up_scale.astype(x.dtype)  # [2, I]
        act = ACTIVATIONS[activation](h[0]) * h[1]
        return _int8_one_row(act[None], down, down_scale)
    h = jnp.einsum("cie,et->cit", _as(gate_up, x.dtype), _feature_major(x))  # [2, I, T]
    if gate_up_scale is not None:
        h = h * gate_up_scale[..., None].astype(h.dtype)
    act = jax.lax.optimization_barrier(ACTIVATIONS[activation](h[0]) * h[1])  # [I, T]
    y = jax.lax.optimization_barrier(_as(down, x.dtype) @ act)  # [E, T]
    if down_scale is not None:
        y = y * down_scale[:, None].astype(y.dtype)
    return y.T


def dense_ffn(x: jax.Array, gate_up, down, kernels, activation: str = "silu") -> jax.Array:
    """The gated FFN of a dense layer (and of a MoE layer's shared expert) -> [T, E], in the
    model's weight layout: "in_out" through the FFN kernel (float weights), "out_in" as
    gated_ffn_out_in, or through the matmul kernel where there is one. Weights of a format
    with its own kernel (packed int4) always go through it. `activation`: the gate's
    (pallas_kernels.fused_ffn.reference.ACTIVATIONS)."""
    if (kernels.matmul is not None and kernels.weight_layout == OUT_IN) or own_kernel(gate_up):
        return gated_ffn_projected(x, gate_up, down, kernels, activation)
    if kernels.weight_layout == IN_OUT:
        gate_up, down = gate_up.dequantized(x.dtype), down.dequantized(x.dtype)
        return kernels.ffn(x, gate_up, down, activation=activation)
    return gated_ffn_out_in(x, gate_up, down, activation)


def swiglu(gate: jax.Array, up: jax.Array, limit: float | None = None) -> jax.Array:
    """silu(gate) * up; with `limit` (DeepSeek-V4's swiglu_limit), gate clamped to <= limit
    and up to [-limit, limit] first."""
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def own_kernel(weight) -> bool:
    """Whether a weight's format multiplies only through its own kernel (`project`): it has
    no array XLA's paths could take (jaxinfer.layers.weights.Int4)."""
    return getattr(weight, "OWN_KERNEL", False)


def lm_logits(x: jax.Array, head, tied: bool, kernels):
    """x [N, E] times the LM head (jaxinfer.layers.weights) -> [N, V] with the model's
    `kernels`. The head is [V, E] when tied (the embedding) or in "out_in", else [E, V]. In
    "out_in" a matmul kernel computes it if there is one (and a format with its own kernel
    always does); else a vocabulary-major head runs as W @ x^T, except for a float head and a
    single row, where the plain matrix-vector product was as fast or faster."""
    layout = kernels.weight_layout
    vocab_major = tied or layout == OUT_IN
    if (layout == OUT_IN and kernels.matmul is not None) or own_kernel(head):
        return head.project(x, kernels)
    w, scale = head.scaled()
    if scale is not None and layout == OUT_IN:
        if x.shape[0] == 1:
            return _int8_one_row(x, w, scale)
        return _int8_vocab_major_logits(x, w, scale)
    w = _as(w, x.dtype)
    if not vocab_major:
        y = x @ w
    elif layout == IN_OUT or x.shape[0] == 1:
        y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
    else:
        y = _token_major(w @ _feature_major(x))
    return y if scale is None else y * scale.astype(y.dtype)


def _vocab_chunk(vocab: int, largest: int = 1024) -> int:
    """The largest divisor of `vocab` up to `largest` (at least 64), else the whole."""
    for size in range(min(largest, vocab), 63, -1):
        if vocab % size == 0:
            return size
    return vocab


def _int8_vocab_major_logits(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """An int8 [V, E] head converted one chunk of rows at a time (each converted chunk stays
    in cache): converting a whole vocabulary-sized head at once runs far slower than the
    float head on XLA:CPU, chunks of 1024 rows as fast or faster."""
    vocab, hidden = w.shape
    chunk = _vocab_chunk(vocab)
    xt = _feature_major(x)  # [E, N]

    def rows(block):  # [C, E] int8 -> [C, N]
        return jax.lax.optimization_barrier(block.astype(x.dtype)) @ xt

    y = jax.lax.map(rows, w.reshape(vocab // chunk, chunk, hidden)).reshape(vocab, -1)
    return (y * scale[:, None].astype(y.dtype)).T
