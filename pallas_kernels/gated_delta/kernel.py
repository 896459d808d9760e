"""The gated delta rule as Pallas kernels for the GPU: `gated_delta`, the "gated_delta"
kernel kind's Pallas entry, runs the recurrent kernel here for a decode step and the chunked
one (chunked.py) for a step with a longer request, like the reference; `chunk=0` keeps the
recurrent kernel for every step (batch_invariant: a token's arithmetic then does not depend
on how its request's tokens were split into steps).

The recurrent form (reference.py: decodes, and any mixed batch) as a Pallas kernel: one
program per (request, value head) walks the request's tokens in order, its [Dk, Dv] state in
registers, reading each token's q, k, v, decay and beta and writing its output; the final
state goes back to the request's slot (outside the kernel, one scatter). q and k are
normalized, repeated to the value heads and q scaled before the kernel (reference._prepare),
so the kernel sees Hv heads throughout.

T: tokens, R: requests, Hv: value heads, Dk / Dv: head dims, S: state slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.gated_delta.chunked import gated_delta_chunked
from pallas_kernels.gated_delta.reference import CHUNK, StateBatch, per_request


def _recurrent_kernel(
    qsl_ref, num_seqs_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, init_ref, o_ref, final_ref
):
    # qsl_ref i32[R + 1]; num_seqs_ref i32[1]; q_ref, k_ref f32[T, Hv, Dk]; v_ref f32[T, Hv, Dv];
    # g_ref, beta_ref f32[T, Hv]; init_ref f32[R, Hv, Dk, Dv]; o_ref f32[T, Hv, Dv];
    # final_ref f32[R, Hv, Dk, Dv]
    r, h = pl.program_id(0), pl.program_id(1)
    start = qsl_ref[r]
    end = jnp.where(r < num_seqs_ref[0], qsl_ref[r + 1], start)

    def token(t, state):  # state [Dk, Dv]
        kt = k_ref[t, h, :]  # [Dk]
        state = state * jnp.exp(g_ref[t, h])
        memory = jnp.sum(state * kt[:, None], axis=0)  # [Dv]
        delta = (v_ref[t, h, :] - memory) * beta_ref[t, h]
        state = state + kt[:, None] * delta[None, :]
        o_ref[t, h, :] = jnp.sum(state * q_ref[t, h, :][:, None], axis=0)
        return state

    final_ref[r, h, :, :] = jax.lax.fori_loop(start, end, token, init_ref[r, h, :, :])


def gated_delta_recurrent(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv], log decay
    beta: jax.Array,  # [T, Hv]
    states: jax.Array,  # f32[S, Hv, Dk, Dv]
    batch: StateBatch,
    *,
    qk_l2norm: bool = True,
    interpret: bool = False,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    """The kernel with the reference's signature."""

    def kernel(q, k, v, g, beta, initial, query_start_loc, num_seqs):
        num_tokens, heads, dv = v.shape
        return gpu_lowering.call(
            _recurrent_kernel,
            out_shape=(
                jax.ShapeDtypeStruct((num_tokens, heads, dv), jnp.float32),
                jax.ShapeDtypeStruct(initial.shape, jnp.float32),
            ),
            grid=(initial.shape[0], heads),
            launch=launch,
            interpret=interpret,
            name="gated_delta_recurrent",
        )(query_start_loc, num_seqs, q, k, v, g, beta, initial)

    return per_request(kernel, q, k, v, g, beta, states, batch, qk_l2norm)


def gated_delta(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv], log decay
    beta: jax.Array,  # [T, Hv]
    states: jax.Array,  # f32[S, Hv, Dk, Dv]
    batch: StateBatch,
    *,
    qk_l2norm: bool = True,
    chunk: int = CHUNK,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    """The recurrent kernel where every request has one token (or chunk is 0), else the
    chunked one (both compiled, one runs)."""
    args = (q, k, v, g, beta, states, batch)
    options = {"qk_l2norm": qk_l2norm, "interpret": interpret}
    if chunk == 0:
        return gated_delta_recurrent(*args, **options)
    longest = jnp.max(jnp.diff(jnp.asarray(batch.query_start_loc)))
    return jax.lax.cond(
        longest > 1,
        lambda: gated_delta_chunked(*args, chunk=chunk, **options),
        lambda: gated_delta_recurrent(*args, **options),
    )
