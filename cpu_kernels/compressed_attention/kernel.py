"""DeepSeek-V4's attention, Lightning Indexer and compressor on XLA:CPU through the C++
kernels in kernel.cc and compressor.h (float32), with the signatures of their pure-JAX
references (pallas_kernels.compressed_attention.reference.compressed_attention,
pallas_kernels.lightning_indexer.reference.indexer_topk,
pallas_kernels.compressor.reference.compress):

    kernels = load_compressed_attention(build_dir)   # compiles kernel.cc once, registers it
    new, closes, state = kernels.compressor(kv, gate, bias, state, batch, overlap=...)
    picks = kernels.lightning_indexer(q, weights, keys, table, query_start_loc, positions, ...)
    out = kernels.compressed_attention(q, kv, block_table, entries, table, picks, sinks, ...)

The stores and the compressors' states may come as stacks over layers with the layer to read
(`kv_layer`, `entry_layer`, `layer`): the kernels read them in place (a layer sliced out of the
cache would be copied for the call), and the compressor updates its layer's rows in place (its
outputs alias the state). Each reads only what a real token sees (its window's positions, its
closed entries or its picks), where the references gather every token's whole window and
store; padding tokens (past query_start_loc[R]) get zeros and no picks.

T: tokens, R: requests, H: heads, D: head dim, NB / BS: the window's blocks and tokens per
block, MB: its blocks per request, NBc / Bc / MBc: the same for the compressed entries, k:
picks, Di: the indexer's head dim, S: state slots, m: tokens per entry, F: the compressor's
features (D, or 2D for CSA's two series).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.build import KernelBuildError, build, load, register
from pallas_kernels.compressor.reference import CompressorBatch, CompressorState

SOURCE = Path(__file__).with_name("kernel.cc")
ATTENTION_TARGET = "jaxinfer_compressed_attention"
INDEXER_TARGET = "jaxinfer_indexer_topk"
COMPRESSOR_TARGET = "jaxinfer_compressor"
WINDOW_ONLY, EVERY_ENTRY, PICKED_ENTRIES = 0, 1, 2  # the attention's modes


def compressed_attention(
    q: jax.Array,  # f32[T, H, D]
    kv: jax.Array,  # f32[NB, BS, D], each position's K=V entry (or [L, ...] with kv_layer)
    block_table: jax.Array,  # i32[R, MB]
    entries: jax.Array | None,  # f32[NBc, Bc, D] (None: none; or [Lc, ...] with entry_layer)
    entry_table: jax.Array | None,  # i32[R, MBc]
    picks: jax.Array | None,  # i32[T, k], the indexer's (-1: none); None: every closed one
    sinks: jax.Array,  # f32[H]
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    *,
    window: int,
    ratio: int,
    scale: float,
    kv_layer: jax.Array | None = None,  # i32[]: kv's layer of a stack, read in place
    entry_layer: jax.Array | None = None,  # i32[]: entries' layer of a stack
) -> jax.Array:  # f32[T, H, D]
    check_float32("compressed_attention", q=q, kv=kv, sinks=sinks, entries=entries)
    num_tokens, _, dim = q.shape
    requests = block_table.shape[0]
    i32 = jnp.int32
    if entries is None:
        mode = WINDOW_ONLY
        entries, entry_layer = jnp.zeros((1, 1, dim), jnp.float32), None
        entry_table = jnp.zeros((requests, 1), i32)
    else:
        mode = EVERY_ENTRY if picks is None else PICKED_ENTRIES
    if picks is None:
        picks = jnp.zeros((num_tokens, 0), i32)
    kv, kv_layer = stacked(kv, kv_layer)
    entries, entry_layer = stacked(entries, entry_layer)
    return jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q,
        kv,
        block_table.astype(i32),
        entries,
        entry_table.astype(i32),
        picks.astype(i32),
        sinks,
        query_start_loc.astype(i32),
        positions.astype(i32),
        kv_layer,
        entry_layer,
        mode=np.int64(mode),
        window=np.int64(window),
        ratio=np.int64(ratio),
        scale=np.float32(scale),
    )


def indexer_topk(
    q: jax.Array,  # f32[T, H, Di]
    weights: jax.Array,  # f32[T, H]
    keys: jax.Array,  # f32[NB, B, Di] (or [L, ...] with layer)
    block_table: jax.Array,  # i32[R, MB]
    query_start_loc: jax.Array,  # i32[R + 1]
    positions: jax.Array,  # i32[T]
    *,
    ratio: int,
    topk: int,
    scale: float,
    layer: jax.Array | None = None,  # i32[]: keys' layer of a stack, read in place
) -> jax.Array:  # i32[T, min(k, MB * B)]: best first; -1 past the visible ones
    check_float32("indexer_topk", q=q, weights=weights, keys=keys)
    keys, layer = stacked(keys, layer)
    picks = min(topk, block_table.shape[1] * keys.shape[2])
    shape = jax.ShapeDtypeStruct((q.shape[0], picks), jnp.int32)
    i32 = jnp.int32
    return jax.ffi.ffi_call(INDEXER_TARGET, shape)(
        q,
        weights,
        keys,
        block_table.astype(i32),
        query_start_loc.astype(i32),
        positions.astype(i32),
        layer,
        ratio=np.int64(ratio),
        scale=np.float32(scale),
    )


def compress(
    kv: jax.Array,  # f32[T, F], the step's tokens projected (kv_proj)
    gate: jax.Array,  # f32[T, F] (gate_proj)
    bias: jax.Array,  # f32[m, F], position_bias
    state: CompressorState,  # rings, each [S, W, F] (or [L, S, W, F] with layer)
    batch: CompressorBatch,
    *,
    overlap: bool,  # CSA's two series (F = 2D); else HCA (F = D)
    layer: jax.Array | None = None,  # i32[]: the state's layer of a stack, updated in place
) -> tuple[jax.Array, jax.Array, CompressorState]:
    """(entries f32[T, D], closes bool[T], the state after the step: the whole stack with
    `layer`), as pallas_kernels.compressor.reference.compress."""
    check_float32("compressor", kv=kv, gate=gate, bias=bias, **state._asdict())
    single = layer is None
    if single:
        state, layer = CompressorState(*(a[None] for a in state)), jnp.zeros((), jnp.int32)
    num_tokens, features = kv.shape
    dim = features // 2 if overlap else features
    shapes = (
        jax.ShapeDtypeStruct((num_tokens, dim), jnp.float32),
        jax.ShapeDtypeStruct((num_tokens,), jnp.bool_),
        *(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in state),
    )
    i32 = jnp.int32
    entries, closes, *new = jax.ffi.ffi_call(
        COMPRESSOR_TARGET, shapes, input_output_aliases={3: 2, 4: 3}
    )(
        kv,
        gate,
        bias,
        *state,
        batch.query_start_loc.astype(i32),
        batch.positions.astype(i32),
        batch.state_rows.astype(i32),
        jnp.asarray(batch.num_seqs, i32).reshape(1),
        jnp.asarray(layer, i32),
        overlap=overlap,
    )
    new = CompressorState(*(a[0] for a in new) if single else new)
    return entries, closes, new


def stacked(array: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(a stack over layers, the layer to read as i32[]): a single layer as a stack of one."""
    if layer is None:
        return array[None], jnp.zeros((), jnp.int32)
    return array, jnp.asarray(layer, jnp.int32)


def check_float32(name: str, **arrays) -> None:
    for key, array in arrays.items():
        if array is not None and array.dtype != jnp.float32:
            raise TypeError(f"{name} takes float32 {key}, got {array.dtype}")


class CompressedKernels(NamedTuple):
    compressed_attention: object  # compressed_attention above
    lightning_indexer: object  # indexer_topk above
    compressor: object  # compress above


def load_compressed_attention(build_dir: Path) -> CompressedKernels:
    """The three kernels, ready to call: builds kernel.cc into `build_dir` if needed and
    registers them. KernelBuildError without a C++ compiler, or on a CPU without AVX2 and
    FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_compressed_attention_supported():
        raise KernelBuildError("the CPU compressed attention kernels need AVX2 and FMA")
    register(library, "JaxinferCompressedAttention", ATTENTION_TARGET)
    register(library, "JaxinferIndexerTopk", INDEXER_TARGET)
    register(library, "JaxinferCompressor", COMPRESSOR_TARGET)
    return CompressedKernels(compressed_attention, indexer_topk, compress)
