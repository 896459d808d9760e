"""The gated FFN with the gate and up products fused in one Pallas kernel.

T: tokens, E: hidden size, I: intermediate size, BT x BI: a program's output tile, BK: the
reduction step over E.

A program computes one [BT, BI] tile of h = silu(x @ W_gate) * (x @ W_up): it walks E in steps
of BK, multiplying the same x tile by the matching columns of W_gate and W_up (the two halves
of the stacked [E, 2, I] weight, read as [E, 2I]), and applies the activation in registers,
so only h [T, I] is written, never the [T, 2I] product. The down projection h @ W_down is one
plain matmul (cuBLAS through XLA on GPU), which is already at the matmul roofline.

Batch invariance (`batch_invariant=True`): BT is fixed (it otherwise grows with T) and the down
projection runs through the Pallas matmul, whose tiles do not depend on T either
(pallas_kernels/matmul), so a row's result does not depend on the other rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.matmul.kernel import BLOCK_T, matmul
from pallas_kernels.tiles import largest_power_of_two_divisor


def default_block_t(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64


def _activation(gate: jax.Array, name: str) -> jax.Array:
    """The gate's activation in float32, written out (the reference's ACTIVATIONS)."""
    if name == "silu":
        return gate / (1.0 + jnp.exp(-gate))
    if name == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        return 0.5 * gate * (1.0 + jnp.tanh(inner))
    raise ValueError(f"activation {name!r} is not one of silu, gelu_tanh")


def _gate_up_kernel(x_ref, w_ref, h_ref, *, block_t, block_i, block_k, intermediate, activation):
    # x_ref [Tp, E], w_ref [E, 2I], h_ref [Tp, I]
    t, i = pl.program_id(0), pl.program_id(1)
    ds = pl.ds
    rows = ds(t * block_t, block_t)
    hidden = x_ref.shape[1]
    # float32 inputs get full-precision dots (a GPU's default for them is TF32)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(k, carry):
        gate, up = carry
        reduce = ds(k * block_k, block_k)
        x = x_ref[rows, reduce]  # [BT, BK]
        gate += jnp.dot(
            x,
            w_ref[reduce, ds(i * block_i, block_i)],
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        up += jnp.dot(
            x,
            w_ref[reduce, ds(intermediate + i * block_i, block_i)],
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return gate, up

    zeros = jnp.zeros((block_t, block_i), jnp.float32)
    gate, up = jax.lax.fori_loop(0, hidden // block_k, body, (zeros, zeros))
    h = _activation(gate, activation) * up  # in float32
    h_ref[rows, ds(i * block_i, block_i)] = h.astype(h_ref.dtype)


def gate_up_activation(
    x: jax.Array,  # [T, E]
    gate_up: jax.Array,  # [E, 2, I]
    *,
    activation: str = "silu",
    interpret: bool = False,
    block_t: int | None = None,
    block_i: int | None = None,
    block_k: int | None = None,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> jax.Array:  # h [T, I]
    num_tokens, hidden = x.shape
    intermediate = gate_up.shape[2]
    gate_up = gate_up.reshape(hidden, 2 * intermediate)  # a view: gate columns, then up
    block_t = block_t or default_block_t(num_tokens)
    block_i = block_i or largest_power_of_two_divisor(intermediate, 128)
    block_k = block_k or largest_power_of_two_divisor(hidden, 64)
    if block_i < 16 or block_k < 16 or intermediate % block_i or hidden % block_k:
        raise ValueError(
            f"the fused FFN kernel tiles E={hidden} by {block_k} and I={intermediate} by "
            f"{block_i}: both must divide evenly and be at least 16"
        )
    padded = -(-num_tokens // block_t) * block_t
    x = jnp.pad(x, ((0, padded - num_tokens), (0, 0)))
    kernel = functools.partial(
        _gate_up_kernel,
        block_t=block_t,
        block_i=block_i,
        block_k=block_k,
        intermediate=intermediate,
        activation=activation,
    )
    h = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((padded, intermediate), x.dtype),
        grid=(padded // block_t, intermediate // block_i),
        launch=launch,
        interpret=interpret,
        name="gate_up_activation",
    )(x, gate_up)
    return h[:num_tokens]


def fused_ffn(
    x: jax.Array,  # [T, E]
    gate_up: jax.Array,  # [E, 2, I]
    down: jax.Array,  # [I, E]
    *,
    activation: str = "silu",
    interpret: bool = False,
    batch_invariant: bool = False,
    **tiles,
) -> jax.Array:  # [T, E]
    """The Pallas kernel with the reference's signature: down(act(x @ W_gate) * (x @ W_up)).
    `batch_invariant`: tiles independent of T, the down projection through the Pallas matmul."""
    if not batch_invariant:
        h = gate_up_activation(x, gate_up, activation=activation, interpret=interpret, **tiles)
        # as in the gate and up dots: float32 gets full precision, not a GPU's default TF32
        precision = jax.lax.Precision.HIGHEST if h.dtype == jnp.float32 else None
        return jnp.dot(h, down, precision=precision)
    tiles.setdefault("block_t", BLOCK_T)
    h = gate_up_activation(x, gate_up, activation=activation, interpret=interpret, **tiles)
    return matmul(h, down, interpret=interpret)
