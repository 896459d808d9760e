"""DeepSeek-V4's compressor in pure JAX: every `ratio` tokens of a request pooled into one
compressed entry, over the flattened batch of a step (the reference of its kernels).

Heavily compressed attention (HCA) pools each window of `ratio` tokens on its own; compressed
sparse attention (CSA) projects two series per token, Ca and Cb, and pools window w's entry
from window w - 1's Ca and window w's Cb (2 * ratio slots, stride ratio; window 0 has no
previous one). Entry w = sum_j softmax_j(gate_j + bias_j) * kv_j, per channel, where bias is
indexed by the token's offset in its own window (the softmax runs over the slots).

A window spans steps (a decode adds one token a step), so each request carries, in its state
slot, a ring of its last W tokens' projections (token p at p % W; W = `ring_size`: a multiple
of ratio, two windows for CSA, one for HCA, plus the most proposals a step verifies). A step's
token that closes a window (position + 1 a multiple of ratio) gets that window's pooled entry;
the RMSNorm and RoPE after the pooling and the entry's place in the paged store are the
layer's. The state is a function of positions alone: a speculative step's rejected tokens
overwrite only positions older than any window still to close reads, and the real tokens at
their positions are written again later, so nothing needs rolling back.

T: tokens in the step, R: requests, S: state slots, m: ratio, W: ring size, D: entry dim, F:
S' * D with S' series (1 for HCA, 2 for CSA).
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
    buffer_kv: jax.Array  # f32[S, W, F], each slot's last W tokens, token p at p % W
    buffer_gate: jax.Array  # f32[S, W, F]


def ring_size(ratio: int, overlap: bool, spare: int = 0) -> int:
    """W: the windows a closing token reads (CSA: its own and the one before), and room for
    `spare` proposals past the accepted tokens, in whole windows. A step that verifies k <=
    spare proposals writes positions up to L + k (L: the first it may reject), overwriting
    p - W <= L + k - W; a window still to close reads positions from L - 2m + 1 (CSA) or
    L - m + 1 (HCA) on, so those stay intact."""
    return ratio * ((2 if overlap else 1) + -(-spare // ratio))


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
    ratio, ring = bias.shape[0], state.buffer_kv.shape[1]
    dim = features // 2 if overlap else features
    request, valid, row, first = token_fields(batch, num_tokens)
    pos = batch.positions
    closes = valid & ((pos + 1) % ratio == 0)
    window = (pos + 1) // ratio - 1  # [T], the window a closing token closes
    offsets = jnp.arange(ratio, dtype=jnp.int32)

    def gather(positions, series):  # positions i32[T, m] -> kv, gate f32[T, m, D]
        """The tokens at `positions` of each token's request: from the step where the step
        holds them, else from the request's ring."""
        columns = slice(0, dim) if series == 0 else slice(features - dim, features)
        in_step = positions >= first[:, None]
        index = jnp.clip(
            jnp.arange(num_tokens)[:, None] + positions - pos[:, None], 0, num_tokens - 1
        )
        step_kv, step_gate = kv[index, columns], gate[index, columns]
        slot = positions % ring
        ring_kv = state.buffer_kv[row[:, None], slot, columns]
        ring_gate = state.buffer_gate[row[:, None], slot, columns]
        kv_out = jnp.where(in_step[..., None], step_kv, ring_kv)
        gate_out = jnp.where(in_step[..., None], step_gate, ring_gate)
        return kv_out, gate_out + bias[positions % ratio, columns]

    own = window[:, None] * ratio + offsets  # [T, m]
    slots_kv, slots_gate = gather(own, 1 if overlap else 0)
    if overlap:
        before_kv, before_gate = gather(own - ratio, 0)
        before_gate = jnp.where((window > 0)[:, None, None], before_gate, -jnp.inf)
        slots_kv = jnp.concatenate([before_kv, slots_kv], axis=1)  # [T, 2m, D]
        slots_gate = jnp.concatenate([before_gate, slots_gate], axis=1)
    weights = jax.nn.softmax(slots_gate, axis=1)
    entries = jnp.where(closes[:, None], (weights * slots_kv).sum(axis=1), 0.0)
    return entries, closes, next_state(kv, gate, state, batch, request, valid, row)


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


def next_state(kv, gate, state, batch, request, valid, row) -> CompressorState:
    """Each request's ring after the step: its last W tokens written at their positions
    modulo W (one write per slot)."""
    num_tokens, features = kv.shape
    slots, ring = state.buffer_kv.shape[:2]
    last = batch.query_start_loc[1:] - 1  # [R], each request's last token in the step
    end = batch.positions[jnp.clip(last, 0, num_tokens - 1)] + 1  # [R], its next position
    keep = valid & (batch.positions >= end[request] - ring)
    flat = (slots * ring, features)
    # (the others at an index past the end, which "drop" leaves out: -1 would wrap around)
    slot = jnp.where(keep, row * ring + batch.positions % ring, flat[0])
    buffer_kv, buffer_gate = (
        buffer.reshape(flat).at[slot].set(values, mode="drop").reshape(buffer.shape)
        for buffer, values in ((state.buffer_kv, kv), (state.buffer_gate, gate))
    )
    return CompressorState(buffer_kv, buffer_gate)
