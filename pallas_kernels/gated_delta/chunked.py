"""The gated delta rule's chunked (WY / UT) form (reference.gated_delta_chunked: prefill
chunks) as a Pallas kernel for the GPU: one program per (request, value head) walks the
request's tokens in chunks of C, its [Dk, Dv] state carried from chunk to chunk, each chunk
through matmuls and one forward substitution over C rows. Per chunk of n <= C tokens (the
rest of the C rows masked: no decay, no update, not written), with c = cumsum(g) over the
chunk and D[i][j] = exp(c_i - c_j):

    T = (I + strictly_lower(beta_i k_i . k_j D[i][j]))^-1
    U = T (beta v) - T (beta k exp(c)) S
    o = (q exp(c)) S + lower(q_i . k_j D[i][j]) U
    S = exp(c_n) S + (k exp(c_n - c))^T U

q and k are normalized, repeated to the value heads and q scaled before the kernel
(reference._prepare). The inputs are padded by C tokens so a chunk's rows never read past
them; outputs past a request's tokens are masked off (they are another request's rows).

T: tokens, R: requests, Hv: value heads, Dk / Dv: head dims, C: chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.gated_delta.reference import CHUNK, StateBatch, per_request

_HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a, b):  # [M, K] @ [K, N] in float32
    return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _dot_t(a, b):  # [K, M]^T @ [K, N]
    return jax.lax.dot_general(
        a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _dot_bt(a, b):  # [M, K] @ [N, K]^T
    return jax.lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32
    )


def _chunked_kernel(
    qsl_ref,
    num_seqs_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    init_ref,
    o_ref,
    final_ref,
    *,
    chunk: int,
):
    # qsl_ref i32[R + 1]; num_seqs_ref i32[1]; q_ref, k_ref f32[T + C, Hv, Dk];
    # v_ref f32[T + C, Hv, Dv]; g_ref, beta_ref f32[T + C, Hv]; init_ref f32[R, Hv, Dk, Dv];
    # o_ref f32[T + C, Hv, Dv]; final_ref f32[R, Hv, Dk, Dv]
    r, h = pl.program_id(0), pl.program_id(1)
    start = qsl_ref[r]
    end = jnp.where(r < num_seqs_ref[0], qsl_ref[r + 1], start)
    rows = jnp.arange(chunk)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = (rows[:, None] == rows[None, :]).astype(jnp.float32)

    def one_chunk(index, state):  # state [Dk, Dv]
        first = start + index * chunk
        tokens = pl.ds(first, chunk)
        inside = first + rows < end  # [C]
        q = q_ref[tokens, h, :]  # [C, Dk]
        k = k_ref[tokens, h, :]
        v = v_ref[tokens, h, :]  # [C, Dv]
        g = jnp.where(inside, g_ref[tokens, h], 0.0)  # [C]
        beta = jnp.where(inside, beta_ref[tokens, h], 0.0)
        cum = jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)  # [C], inclusive
        decays = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))  # [C, C]
        system = jnp.where(strict, _dot_bt(k, k) * decays * beta[:, None], 0.0)

        def row(i, inverse):  # forward substitution: T_i = e_i - L_i T (rows < i final)
            l_i = jnp.sum(jnp.where(rows[:, None] == i, system, 0.0), axis=0)  # [C]
            update = jnp.sum(l_i[:, None] * inverse, axis=0)  # [C]
            return inverse - jnp.where(rows[:, None] == i, update[None, :], 0.0)

        inverse = jax.lax.fori_loop(1, chunk, row, eye)  # [C, C]
        grow = jnp.exp(cum)[:, None]  # [C, 1]
        fresh = _dot(inverse, v * beta[:, None]) - _dot(
            _dot(inverse, k * (beta[:, None] * grow)), state
        )  # [C, Dv]
        attn = jnp.where(causal, _dot_bt(q, k) * decays, 0.0)
        out = _dot(q * grow, state) + _dot(attn, fresh)
        gpu_lowering.masked_store(o_ref.at[tokens, h, :], out, inside[:, None])
        last = jnp.sum(g)  # the chunk's total decay (log)
        k_out = k * jnp.exp(last - cum)[:, None]
        return state * jnp.exp(last) + _dot_t(k_out, fresh)

    count = (end - start + chunk - 1) // chunk
    final_ref[r, h, :, :] = jax.lax.fori_loop(0, count, one_chunk, init_ref[r, h, :, :])


def gated_delta_chunked(
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
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    """The kernel with the reference's signature."""

    def kernel(q, k, v, g, beta, initial, query_start_loc, num_seqs):
        num_tokens, heads, dv = v.shape
        padded = [jnp.pad(a, [(0, chunk)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta)]
        out, final = gpu_lowering.call(
            lambda *refs: _chunked_kernel(*refs, chunk=chunk),
            out_shape=(
                jax.ShapeDtypeStruct((num_tokens + chunk, heads, dv), jnp.float32),
                jax.ShapeDtypeStruct(initial.shape, jnp.float32),
            ),
            grid=(initial.shape[0], heads),
            launch=launch,
            interpret=interpret,
            name="gated_delta_chunked",
        )(query_start_loc, num_seqs, *padded, initial)
        return out[:num_tokens], final

    return per_request(kernel, q, k, v, g, beta, states, batch, qk_l2norm)
