"""DeepSeek-V4's compressor as a Pallas kernel (the reference's signature and entries,
pallas_kernels/compressor/reference.py): one program per token pools the window the token
closes, its `ratio` slots (CSA: and the window before's, from the other series) each read
from the step where the step holds it, else from the request's ring; the softmax over the
slots runs per channel, sum_j e_j kv_j / sum_j e_j with e_j = exp(gate_j + bias_j - max).
A token that closes no window writes zeros. The rings after the step are the reference's
scatter (reference.next_state).

A window's slots are a run of the step's rows ending at the closing token (its earlier tokens
in the step, in order), and a run of the ring's rows (a position's row is it modulo W, a
multiple of ratio: a window's rows are contiguous), so each program reads two tiles of
`ratio` rows per series; the step's rows
are padded in front so that a run before a request's first token still lies in the array
(those rows are masked). Float32; `ratio` and the entry dim must be powers of two (Triton's
tiles).

T: tokens in the step, R: requests, S: state slots, m: ratio, W: ring size, D: entry dim, F:
S' * D with S' series (1 for HCA, 2 for CSA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import gpu_lowering
from pallas_kernels.compressor.reference import (
    CompressorBatch,
    CompressorState,
    layer_state,
    next_state,
    token_fields,
    with_layer_state,
)
from pallas_kernels.tiles import check_powers_of_two

MASK_VALUE = -1e30  # a slot's gate where it has no token (CSA's window before the first)


def _kernel(
    closes_ref,  # i32[T], 1 where the token closes a window
    position_ref,  # i32[T]
    first_ref,  # i32[T], the position of its request's first token in the step
    row_ref,  # i32[T], its request's state slot
    kv_ref,  # f32[P + T, F], the step's rows after P padding rows
    gate_ref,  # f32[P + T, F]
    bias_ref,  # f32[m, F]
    buffer_kv_ref,  # f32[S * W, F], each slot's ring
    buffer_gate_ref,  # f32[S * W, F]
    entries_ref,  # f32[T, D]
    *,
    ratio: int,
    ring: int,
    dim: int,
    overlap: bool,
):
    t = pl.program_id(0)
    position, first, row = position_ref[t], first_ref[t], row_ref[t]
    pad = 2 * ratio
    window = (position + 1) // ratio - 1
    offsets = jnp.arange(ratio)[:, None]  # [m, 1]

    def series(columns: int, back: int):
        """(kv, gate + bias) [m, D] of the window `back` windows before the token's, from the
        series at `columns`."""
        starts = window * ratio - back * ratio  # its first position (< 0: none, masked)
        in_step = starts + offsets >= first  # [m, 1]
        rows = pl.ds(t + pad - (back + 1) * ratio + 1, ratio)
        cols = pl.ds(columns, dim)
        slots = pl.ds(row * ring + jnp.maximum(starts, 0) % ring, ratio)
        kv = jnp.where(in_step, kv_ref[rows, cols], buffer_kv_ref[slots, cols])
        gate = jnp.where(in_step, gate_ref[rows, cols], buffer_gate_ref[slots, cols])
        return kv, gate + bias_ref[:, cols]

    own_kv, own_gate = series(dim if overlap else 0, 0)
    peak = own_gate.max(axis=0)  # [D]
    if overlap:
        before_kv, before_gate = series(0, 1)
        before_gate = jnp.where(window > 0, before_gate, MASK_VALUE)
        before_kv = jnp.where(window > 0, before_kv, 0.0)
        peak = jnp.maximum(peak, before_gate.max(axis=0))
    weights = jnp.exp(own_gate - peak[None, :])  # [m, D]
    total, norm = (weights * own_kv).sum(axis=0), weights.sum(axis=0)
    if overlap:
        weights = jnp.exp(before_gate - peak[None, :])
        total, norm = total + (weights * before_kv).sum(axis=0), norm + weights.sum(axis=0)
    entries_ref[t, :] = jnp.where(closes_ref[t] > 0, total / norm, 0.0)


def compress(
    kv: jax.Array,  # f32[T, F], the step's tokens projected (kv_proj)
    gate: jax.Array,  # f32[T, F] (gate_proj)
    bias: jax.Array,  # f32[m, F], position_bias
    state: CompressorState,
    batch: CompressorBatch,
    *,
    overlap: bool,  # CSA's two series (F = 2D); else HCA (F = D)
    layer: jax.Array | None = None,  # i32[]: the state's layer of a stack ([L, S, W, F])
    interpret: bool = False,
    launch: gpu_lowering.LaunchConfig = gpu_lowering.LaunchConfig(),  # noqa: B008 (frozen)
) -> tuple[jax.Array, jax.Array, CompressorState]:
    """Returns (entries f32[T, D]: the pooled entry of the window each token closes, zeros
    for the others; closes bool[T]; the state after the step: with `layer`, the whole
    stack), as the reference."""
    if layer is not None:
        entries, closes, new = compress(
            kv, gate, bias, layer_state(state, layer), batch, overlap=overlap,
            interpret=interpret, launch=launch,
        )  # fmt: skip
        return entries, closes, with_layer_state(state, layer, new)
    num_tokens, features = kv.shape
    ratio = bias.shape[0]
    dim = features // 2 if overlap else features
    check_powers_of_two("compressor", ratio=ratio, dim=dim)
    request, valid, row, first = token_fields(batch, num_tokens)
    closes = valid & ((batch.positions + 1) % ratio == 0)
    slots, ring = state.buffer_kv.shape[:2]
    if ring % ratio:
        raise ValueError(f"compressor: the ring's {ring} rows are not whole windows of {ratio}")
    kv, gate = kv.astype(jnp.float32), gate.astype(jnp.float32)
    padding = ((2 * ratio, 0), (0, 0))
    kernel = functools.partial(_kernel, ratio=ratio, ring=ring, dim=dim, overlap=overlap)
    entries = gpu_lowering.call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_tokens, dim), jnp.float32),
        grid=(num_tokens,),
        launch=launch,
        interpret=interpret,
        name="compressor",
    )(
        closes.astype(jnp.int32),
        batch.positions.astype(jnp.int32),
        first.astype(jnp.int32),
        row.astype(jnp.int32),
        jnp.pad(kv, padding),
        jnp.pad(gate, padding),
        bias.astype(jnp.float32),
        state.buffer_kv.reshape(slots * ring, features).astype(jnp.float32),
        state.buffer_gate.reshape(slots * ring, features).astype(jnp.float32),
    )
    new_state = next_state(kv, gate, state, batch, request, valid, row)
    return entries, closes, new_state
