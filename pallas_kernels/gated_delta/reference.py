"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3-Next and
Qwen3.5) in pure JAX, in its two forms, each over a flattened mixed batch like the attention
kernels:

- recurrent: one token at a time (decodes, and the check of the other form);
- chunked: the WY / UT-transform algorithm, chunks of C tokens through a few matmuls and a
  triangular solve each, the state carried from chunk to chunk (prefill chunks).

gated_delta_reference takes either per step (the "gated_delta" kernel kind's contract); the
recurrent form has a Pallas kernel beside it (kernel.py) and a C++ one for XLA:CPU
(cpu_kernels/gated_delta), each with this signature.

Per value head, with state S [Dk, Dv] and a token's q, k [Dk], v [Dv], decay g (log space,
<= 0) and beta in (0, 1):

    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q / sqrt(Dk)

q and k are L2-normalized first (Qwen's models ask for it). A model's value heads may
outnumber its key heads: each key head serves Hv / Hk consecutive value heads.

The batch (StateBatch): tokens T flattened, request r's at query_start_loc[r] ..
query_start_loc[r + 1]; each request's state lives in slot state_slots[r] of `states`
[S, Hv, Dk, Dv], starting from zeros where `fresh[r]` (its first tokens) and from the slot's
content otherwise (a chunked prefill's next chunk, a decode); requests from num_seqs on are
padding and change nothing.
Both forms return (o [T, Hv, Dv], states with every real request's slot updated).

T: tokens, R: requests, Hk / Hv: key / value heads, Dk / Dv: their dims, S: state slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import token_request_index

CHUNK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateBatch:
    """Where a flattened batch's requests are and which state slot each reads and writes."""

    query_start_loc: jax.Array  # i32[R + 1]
    state_slots: jax.Array  # i32[R]
    fresh: jax.Array  # bool[R], the request's first tokens: its states start from zeros
    num_seqs: jax.Array  # i32[1], requests that are real

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return tuple(
            jnp.asarray(a)
            for a in (self.query_start_loc, self.state_slots, self.fresh, self.num_seqs)
        )


def _tree_sum(x: jax.Array) -> jax.Array:  # [..., N] -> [..., 1]
    """The sum over the last axis by pairwise halves (an odd length gets a zero appended):
    elementwise adds only, so a row's sum does not depend on the array's shape (XLA's own
    reductions choose their blocking from it; batch_invariant)."""
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1])], axis=-1)
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / |x| over the last axis (as the FLA library and HF: rsqrt of the sum plus eps)."""
    return x * jax.lax.rsqrt(_tree_sum(x * x) + eps)


def _read(state: jax.Array, key: jax.Array) -> jax.Array:  # [Hv, Dk, Dv], [Hv, Dk] -> [Hv, Dv]
    """S^T k per head, its sum over Dk a fixed tree."""
    return _tree_sum(jnp.swapaxes(state * key[:, :, None], -1, -2))[..., 0]


def _prepare(q, k, v, g, beta, qk_l2norm: bool):
    """float32 copies, q and k normalized and repeated to the value heads, q scaled."""
    q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    groups = v.shape[1] // k.shape[1]
    q, k = jnp.repeat(q, groups, axis=1), jnp.repeat(k, groups, axis=1)  # [T, Hv, Dk]
    return q * q.shape[-1] ** -0.5, k, v, g, beta


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
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    """Token by token, each reading and writing its request's slot."""
    out_dtype = jnp.asarray(v).dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_l2norm)
    query_start_loc, state_slots, fresh, num_seqs = batch.arrays()
    states = jnp.asarray(states, jnp.float32)
    num_tokens, num_reqs = q.shape[0], state_slots.shape[0]
    request = token_request_index(query_start_loc, num_tokens)
    real = request < jnp.minimum(num_seqs[0], num_reqs)
    safe = jnp.minimum(request, num_reqs - 1)
    first = jnp.arange(num_tokens) == query_start_loc[safe]

    def step(states, token):
        qt, kt, vt, gt, bt, slot, start, valid = token
        state = jnp.where(start, 0.0, states[slot])  # [Hv, Dk, Dv]
        state = state * jnp.exp(gt)[:, None, None]
        delta = (vt - _read(state, kt)) * bt[:, None]
        state = state + kt[:, :, None] * delta[:, None, :]
        out = _read(state, qt)
        states = jnp.where(valid, states.at[slot].set(state), states)
        return states, out

    tokens = (q, k, v, g, beta, state_slots[safe], first & fresh[safe], real)
    states, out = jax.lax.scan(step, states, tokens)
    return jnp.where(real[:, None, None], out, 0.0).astype(out_dtype), states


def per_request(
    kernel,
    q,
    k,
    v,
    g,
    beta,
    states,
    batch: StateBatch,
    qk_l2norm: bool = True,
    *,
    prepared: bool = True,
):
    """A kernel that walks each request from its initial state, with the signature of the
    forms here: `kernel(q, k, v, g, beta, initial, query_start_loc, num_seqs)` (g and beta
    [T, Hv], v [T, Hv, Dv], initial f32[R, Hv, Dk, Dv]) returns (o [T, Hv, Dv], final
    [R, Hv, Dk, Dv]); with `prepared` its q and k come normalized, repeated to the value heads
    and q scaled ([T, Hv, Dk]), else as given (float32 [T, Hk, Dk]: the kernel does it). Here
    each request's initial state is gathered from its slot (zeros when fresh), the finals of
    real requests scattered back to their slots, and the outputs of padding tokens zeroed (a
    kernel need not write them)."""
    out_dtype = jnp.asarray(v).dtype
    if prepared:
        q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_l2norm)
    else:
        q, k, v, g, beta = (jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta))
    query_start_loc, state_slots, fresh, num_seqs = batch.arrays()
    states = jnp.asarray(states, jnp.float32)
    num_tokens, num_reqs = v.shape[0], state_slots.shape[0]
    initial = jnp.where(fresh[:, None, None, None], 0.0, states[state_slots])
    qsl, count = query_start_loc.astype(jnp.int32), num_seqs.astype(jnp.int32)
    out, final = kernel(q, k, v, g, beta, initial, qsl, count)
    real = token_request_index(query_start_loc, num_tokens) < jnp.minimum(num_seqs[0], num_reqs)
    slots = jnp.where(jnp.arange(num_reqs) < num_seqs[0], state_slots, states.shape[0])
    out = jnp.where(real[:, None, None], out, 0.0).astype(out_dtype)
    return out, states.at[slots].set(final, mode="drop")


def _chunked_one(q, k, v, g, beta, state, chunk: int):
    """One sequence (already prepared; [L, Hv, ...] with L a multiple of `chunk`) from
    `state` [Hv, Dk, Dv]: HF's torch_chunk_gated_delta_rule, a scan over the chunks."""
    length, heads = q.shape[0], q.shape[1]
    num_chunks = length // chunk

    def chunks(a):  # [L, Hv, ...] -> [N, Hv, C, ...]
        return jnp.moveaxis(a.reshape(num_chunks, chunk, heads, *a.shape[2:]), 1, 2)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [N, Hv, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pairwise = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    # The UT system (I + strictly lower (beta K K^T * decay)), solved for the chunk's new
    # values and the decayed keys that read the state.
    system = jnp.where(strict, (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise, 0.0)
    system = system + jnp.eye(chunk, dtype=system.dtype)
    solve = jax.vmap(jax.vmap(lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True)))
    new_values = solve(system, v_beta)  # [N, Hv, C, Dv]
    k_cumdecay = solve(system, k_beta * jnp.exp(cum)[..., None])  # [N, Hv, C, Dk]
    attn = jnp.where(causal, (q @ jnp.swapaxes(k, -1, -2)) * pairwise, 0.0)  # [N, Hv, C, C]
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [N, Hv, 1, 1]

    def step(state, parts):
        nv, kc, a, qd, kd, decay = parts
        fresh_values = nv - kc @ state  # [Hv, C, Dv]
        out = qd @ state + a @ fresh_values
        state = state * decay + jnp.swapaxes(kd, -1, -2) @ fresh_values
        return state, out

    parts = (new_values, k_cumdecay, attn, q_decayed, k_decayed, chunk_decay)
    state, out = jax.lax.scan(step, state, parts)  # out [N, Hv, C, Dv]
    return jnp.moveaxis(out, 2, 1).reshape(length, heads, -1), state


def gated_delta_chunked(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv]
    beta: jax.Array,  # [T, Hv]
    states: jax.Array,  # f32[S, Hv, Dk, Dv]
    batch: StateBatch,
    *,
    qk_l2norm: bool = True,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    """Each request's tokens in chunks of `chunk` (the step's T tokens, padded to chunks, are
    every request's window: tokens past its own have no decay and no update)."""
    out_dtype = jnp.asarray(v).dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, qk_l2norm)
    query_start_loc, state_slots, fresh, num_seqs = batch.arrays()
    states = jnp.asarray(states, jnp.float32)
    num_tokens, num_reqs = q.shape[0], state_slots.shape[0]
    window = -(-num_tokens // chunk) * chunk
    position = jnp.arange(window)

    def one(r):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        index = jnp.minimum(start + position, num_tokens - 1)
        inside = (position < end - start) & (r < num_seqs[0])
        mask = inside[:, None]
        parts = [
            jnp.where(mask[..., None], q[index], 0.0),
            jnp.where(mask[..., None], k[index], 0.0),
            jnp.where(mask[..., None], v[index], 0.0),
            jnp.where(mask, g[index], 0.0),  # no decay past the request's tokens
            jnp.where(mask, beta[index], 0.0),  # and no update
        ]
        state = jnp.where(fresh[r], 0.0, states[state_slots[r]])
        out, state = _chunked_one(*parts, state, chunk)
        return out, state

    outs, finals = jax.lax.map(one, jnp.arange(num_reqs))  # [R, W, Hv, Dv], [R, Hv, Dk, Dv]
    real = jnp.arange(num_reqs) < num_seqs[0]
    slots = jnp.where(real, state_slots, states.shape[0])  # padding: dropped
    states = states.at[slots].set(finals, mode="drop")
    # Each token's output from its request's window.
    request = token_request_index(query_start_loc, num_tokens)
    safe = jnp.minimum(request, num_reqs - 1)
    offset = jnp.arange(num_tokens) - query_start_loc[safe]
    out = outs[safe, jnp.clip(offset, 0, window - 1)]
    out = jnp.where((request < num_seqs[0])[:, None, None], out, 0.0)
    return out.astype(out_dtype), states


def gated_delta_reference(
    q: jax.Array,  # [T, Hk, Dk]
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    g: jax.Array,  # [T, Hv], log decay
    beta: jax.Array,  # [T, Hv]
    states: jax.Array,  # f32[S, Hv, Dk, Dv]
    batch: StateBatch,
    *,
    qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:  # (o [T, Hv, Dv] in v's dtype, states)
    """The "gated_delta" kernel kind's contract, one call over a mixed batch: the recurrent
    form where every request has one token (a decode step), else the chunked form (both
    compiled, one runs)."""
    args = (q, k, v, g, beta, states, batch)
    longest = jnp.max(jnp.diff(jnp.asarray(batch.query_start_loc)))
    return jax.lax.cond(
        longest > 1,
        lambda: gated_delta_chunked(*args, qk_l2norm=qk_l2norm),
        lambda: gated_delta_recurrent(*args, qk_l2norm=qk_l2norm),
    )
