"""DeepSeek-V4's compressor in pure JAX: every `ratio` tokens of a request pooled into one
compressed entry, over the flattened batch of a step (the reference of its kernels).

Heavily compressed attention (HCA) pools each window of `ratio` tokens on its own; compressed
sparse attention (CSA) projects two series per token, Ca and Cb, and pools window w's entry
from window w - 1's Ca and window w's Cb (2 * ratio slots, stride ratio; window 0 has no
previous one). Entry w = sum_j softmax_j(gate_j + bias_j) * kv_j, per channel, where bias is
indexed by the token's offset in its own window (the softmax runs over the slots).

A window spans steps (a decode adds one token a step), so each request carries, in its state
slot, the tokens of its open window seen so far (`buffer`) and, for CSA, the last closed
window's Ca (`previous`). A step's token that closes a window (position + 1 a multiple of
ratio) gets that window's pooled entry; the RMSNorm and RoPE after the pooling and the
entry's place in the paged store are the layer's.

T: tokens in the step, R: requests, S: state slots, m: ratio, D: entry dim, F: S' * D with S'
series (1 for HCA, 2 for CSA).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import token_request_index


class CompressorBatch(NamedTuple):
    query_start_loc: jax.Array  # i32[R + 1], each request's first token in the step
    positions: jax.Array  # i32[T]
    state_rows: jax.Array  # i32[R], each request's state slot
    num_seqs: jax.Array  # i32[1], requests in the step (the rest are padding)


class CompressorState(NamedTuple):
    buffer_kv: jax.Array  # f32[S, m, F], the open window's tokens, by offset in the window
    buffer_gate: jax.Array  # f32[S, m, F]
    previous_kv: jax.Array  # f32[S, m, D], the last closed window's Ca (CSA; else [S, 0, D])
    previous_gate: jax.Array  # f32[S, m, D]


def compress(
    kv: jax.Array,  # f32[T, F], the step's tokens projected (kv_proj)
    gate: jax.Array,  # f32[T, F] (gate_proj)
    bias: jax.Array,  # f32[m, F], position_bias
    state: CompressorState,
    batch: CompressorBatch,
    *,
    overlap: bool,  # CSA's two series (F = 2D); else HCA (F = D)
    layer: jax.Array | None = None,  # i32[]: the state's layer of a stack ([L, S, m, *])
) -> tuple[jax.Array, jax.Array, CompressorState]:
    """Returns (entries f32[T, D]: the pooled entry of the window each token closes, zeros
    for the others; closes bool[T]; the state after the step: with `layer`, the whole stack
    with that layer's updated)."""
    if layer is not None:
        entries, closes, new = compress(
            kv, gate, bias, layer_state(state, layer), batch, overlap=overlap
        )
        return entries, closes, with_layer_state(state, layer, new)
    num_tokens, features = kv.shape
    ratio = bias.shape[0]
    dim = features // 2 if overlap else features
    request, valid, row, first = token_fields(batch, num_tokens)
    pos = batch.positions
    closes = valid & ((pos + 1) % ratio == 0)
    window = (pos + 1) // ratio - 1  # [T], the window a closing token closes
    offsets = jnp.arange(ratio, dtype=jnp.int32)

    def gather(positions, series):  # positions i32[T, m] -> kv, gate f32[T, m, D]
        """The tokens at `positions` of each token's request: from the step where the step
        holds them, else from the open window's buffer, else (CSA's Ca of the window
        before the open one) from `previous`."""
        columns = slice(0, dim) if series == 0 else slice(features - dim, features)
        in_step = positions >= first[:, None]
        index = jnp.clip(
            jnp.arange(num_tokens)[:, None] + positions - pos[:, None], 0, num_tokens - 1
        )
        step_kv, step_gate = kv[index, columns], gate[index, columns]
        slot = positions % ratio
        buffer_kv = state.buffer_kv[row[:, None], slot, columns]
        buffer_gate = state.buffer_gate[row[:, None], slot, columns]
        in_buffer = (positions // ratio) == (first // ratio)[:, None]
        if overlap:
            buffer_kv = jnp.where(
                in_buffer[..., None], buffer_kv, state.previous_kv[row[:, None], slot]
            )
            buffer_gate = jnp.where(
                in_buffer[..., None], buffer_gate, state.previous_gate[row[:, None], slot]
            )
        kv_out = jnp.where(in_step[..., None], step_kv, buffer_kv)
        gate_out = jnp.where(in_step[..., None], step_gate, buffer_gate) + bias[slot, columns]
        return kv_out, gate_out

    own = window[:, None] * ratio + offsets  # [T, m]
    slots_kv, slots_gate = gather(own, 1 if overlap else 0)
    if overlap:
        before_kv, before_gate = gather(own - ratio, 0)
        before_gate = jnp.where((window > 0)[:, None, None], before_gate, -jnp.inf)
        slots_kv = jnp.concatenate([before_kv, slots_kv], axis=1)  # [T, 2m, D]
        slots_gate = jnp.concatenate([before_gate, slots_gate], axis=1)
    weights = jax.nn.softmax(slots_gate, axis=1)
    entries = jnp.where(closes[:, None], (weights * slots_kv).sum(axis=1), 0.0)
    return entries, closes, next_state(kv, gate, state, batch, request, valid, row, first, overlap)


def layer_state(state: CompressorState, layer) -> CompressorState:
    """One layer's state of a stack."""
    return CompressorState(*(a[layer] for a in state))


def with_layer_state(state: CompressorState, layer, new: CompressorState) -> CompressorState:
    """The stack with one layer's state replaced."""
    return CompressorState(*(a.at[layer].set(b) for a, b in zip(state, new, strict=True)))


def token_fields(
    batch: CompressorBatch, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per token i32[T]: its request (padding tokens: the last), whether it is real, its
    request's state slot, and the position of its request's first token in the step."""
    request = token_request_index(batch.query_start_loc, num_tokens)
    valid = request < batch.num_seqs[0]
    request = jnp.minimum(request, batch.state_rows.shape[0] - 1)
    first = batch.positions[batch.query_start_loc[request]]
    return request, valid, batch.state_rows[request], first


def next_state(kv, gate, state, batch, request, valid, row, first, overlap) -> CompressorState:
    """Each request's open window after the step in its buffer, and (CSA) the Ca of the last
    window the step closed, if it closed one."""
    num_tokens, features = kv.shape
    ratio = state.buffer_kv.shape[1]
    pos = batch.positions
    last = batch.query_start_loc[1:] - 1  # [R], each request's last token in the step
    num_reqs = last.shape[0]
    live = jnp.arange(num_reqs) < batch.num_seqs[0]
    end = batch.positions[jnp.clip(last, 0, num_tokens - 1)] + 1  # [R], its next position
    open_after = end // ratio  # [R], the window open after the step
    in_open = valid & (pos >= open_after[request] * ratio)  # tokens the buffer keeps
    flat = (state.buffer_kv.shape[0] * ratio, features)
    # (the others at an index past the end, which "drop" leaves out: -1 would wrap around)
    slot = jnp.where(in_open, row * ratio + pos % ratio, flat[0])
    buffer_kv = (
        state.buffer_kv.reshape(flat).at[slot].set(kv, mode="drop").reshape(state.buffer_kv.shape)
    )
    buffer_gate = (
        state.buffer_gate.reshape(flat)
        .at[slot]
        .set(gate, mode="drop")
        .reshape(state.buffer_gate.shape)
    )
    if not overlap:
        return CompressorState(buffer_kv, buffer_gate, state.previous_kv, state.previous_gate)
    dim = features // 2
    rows = batch.state_rows  # [R]
    starts = batch.query_start_loc[:-1]
    firsts = batch.positions[jnp.clip(starts, 0, num_tokens - 1)]
    closed = live & (open_after > firsts // ratio)  # the step closed a window
    positions = (open_after - 1)[:, None] * ratio + jnp.arange(ratio)  # [R, m]
    in_step = positions >= firsts[:, None]
    index = jnp.clip(starts[:, None] + positions - firsts[:, None], 0, num_tokens - 1)
    slot = positions % ratio
    ca_kv = jnp.where(
        in_step[..., None], kv[index, :dim], state.buffer_kv[rows[:, None], slot, :dim]
    )
    ca_gate = jnp.where(
        in_step[..., None], gate[index, :dim], state.buffer_gate[rows[:, None], slot, :dim]
    )
    target = jnp.where(closed, rows, state.previous_kv.shape[0])  # (dropped: out of range)
    previous_kv = state.previous_kv.at[target].set(ca_kv, mode="drop")
    previous_gate = state.previous_gate.at[target].set(ca_gate, mode="drop")
    return CompressorState(buffer_kv, buffer_gate, previous_kv, previous_gate)
