"""DeepSeek-V4's cache (jaxinfer.models.deepseek_v4), one pytree threaded through the step
(donated, updated in place):

- `window`: every layer's shared K=V entry of each position, paged like K/V (the batch's
  block_tables and slot_mapping); a query reads only the last sliding_window positions, so
  blocks behind the window can be released.
- `entries`: the compressed entries of each compressed layer kind ("csa", "hca") and the
  Lightning Indexer's keys ("index", CSA's layers), each a paged store of entries with the
  kind's own block table (entry e of a request lives in block table[e // B], offset e % B).
  CSA's indexer keys share CSA's table. The kinds' tables are columns of the batch's block
  tables after the window's (`entry_columns`), so they travel as block-table rows do.
- `states`: each compressed layer's compressor state (a ring of the request's last tokens'
  projections, sized for the proposals a step verifies: pallas_kernels.compressor.reference
  .CompressorState, .ring_size), in state slots by request row (batch.state_rows), as a
  hybrid's recurrent state is.
- `mtp` (with speculative_method "mtp", else empty): the multi-token-prediction layer's own
  window store "window" [1, NB, BS, D] (jaxinfer.models.deepseek_v4_mtp), and "streams"
  [Tmax, N, E], the model's residual streams of the latest step's tokens before its final
  collapse, which the MTP layer reads after the step (jaxinfer.engine.speculation.mtp).

L: layers, NB / BS: window blocks and positions per block, Lc / Lh: CSA / HCA layers,
NBk / B: a store's blocks and entries per block, D: head dim, Di: the indexer's, S: slots,
m: the kind's ratio, N / E: streams and hidden size, Tmax: the largest step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.arch_config import (
    COMPRESSED_SPARSE_ATTENTION,
    HEAVILY_COMPRESSED_ATTENTION,
    LlamaConfig,
)
from pallas_kernels.compressor.reference import CompressorState, ring_size

# the stores' and states' names, by layer kind
KIND_KEYS = {COMPRESSED_SPARSE_ATTENTION: "csa", HEAVILY_COMPRESSED_ATTENTION: "hca"}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["window", "entries", "states", "mtp"],
    meta_fields=["entry_columns"],
)
@dataclasses.dataclass(frozen=True)
class CompressedCache:
    window: jax.Array  # [L, NB, BS, D]
    entries: dict  # "csa" / "hca": [Lk, NBk, B, D]; "index": [Lc, NBc, B, Di]
    states: dict  # "csa" / "hca" / "index": CompressorState, stacked [Lk, S, W, F]
    # (key, first column, end column): each kind's table in the block tables' columns
    entry_columns: tuple[tuple[str, int, int], ...]
    mtp: dict = dataclasses.field(default_factory=dict)  # "window": [1, NB, BS, D],
    #                                                      "streams": f32[Tmax, N, E]

    def entry_table(self, block_tables: jax.Array, key: str) -> jax.Array:  # i32[R, MBk]
        _, start, end = next(c for c in self.entry_columns if c[0] == key)
        return block_tables[:, start:end]


def entry_columns(
    config: LlamaConfig, block_size: int, max_model_len: int
) -> tuple[tuple[str, int, int], ...]:
    """Where each compressed kind's block table sits in a block-table row: after the
    window's blocks (one per block_size positions), its blocks of block_size entries."""
    v4 = config.compressed
    start = -(-max_model_len // block_size)
    columns = []
    for kind, key in KIND_KEYS.items():
        if v4.count(kind):
            width = -(-(max_model_len // v4.ratio(kind)) // block_size)
            columns.append((key, start, start + width))
            start += width
    return tuple(columns)


def allocate(
    config: LlamaConfig,
    num_blocks: int,
    block_size: int,
    entry_blocks: dict[str, int],  # "csa" / "hca": blocks of that store
    num_slots: int,
    max_model_len: int,
    dtype=jnp.float32,
    zeros=jnp.zeros,  # (shape, dtype) -> array: where the arrays are made (a mesh's)
    num_speculative_tokens: int = 0,  # the most proposals a step verifies (the rings' spare)
    mtp_tokens: int = 0,  # the largest step, with an MTP layer (else 0: none)
) -> CompressedCache:
    """A zeroed cache: `entry_blocks[key]` blocks of `block_size` entries per compressed
    store, `num_slots` compressor states per compressed layer; with `mtp_tokens`, the MTP
    layer's window store and the streams of a step of that many tokens."""
    v4, d = config.compressed, config.head_dim
    window = zeros((config.num_hidden_layers, num_blocks, block_size, d), dtype)
    entries, states = {}, {}
    for kind, key in KIND_KEYS.items():
        layers = v4.count(kind)
        if not layers:
            continue
        ratio, series = v4.ratio(kind), 2 if key == "csa" else 1
        entries[key] = zeros((layers, entry_blocks[key], block_size, d), dtype)
        ring = ring_size(ratio, series == 2, num_speculative_tokens)
        states[key] = _state(layers, num_slots, ring, d * series, zeros)
        if key == "csa":
            di = v4.index_head_dim
            entries["index"] = zeros((layers, entry_blocks[key], block_size, di), dtype)
            states["index"] = _state(layers, num_slots, ring, di * series, zeros)
    mtp = {}
    if mtp_tokens:
        mtp["window"] = zeros((1, num_blocks, block_size, d), dtype)
        mtp["streams"] = zeros((mtp_tokens, v4.hc_mult, config.hidden_size), jnp.float32)
    return CompressedCache(
        window, entries, states, entry_columns(config, block_size, max_model_len), mtp
    )


def compressor_bytes_per_slot(config: LlamaConfig, num_speculative_tokens: int = 0) -> int:
    """Bytes one request's compressor states take over all compressed layers (float32)."""
    cache = jax.eval_shape(
        lambda: allocate(
            config, 1, 1, {"csa": 1, "hca": 1}, 1, 1, num_speculative_tokens=num_speculative_tokens
        )
    )
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache.states))


def _state(layers: int, slots: int, ring: int, features: int, zeros) -> CompressorState:
    """Float32 throughout (the pooling's softmax runs in float32, as HF's does)."""
    shape = (layers, slots, ring, features)
    return CompressorState(zeros(shape, jnp.float32), zeros(shape, jnp.float32))


def write_entries(
    store: jax.Array,  # [Lk, NBk, B, Dk], the kind's stores
    layer: int,  # the layer's index among the kind's
    entries: jax.Array,  # [T, Dk], the entry each token closes
    closes: jax.Array,  # bool[T]
    table: jax.Array,  # i32[R, MBk], the kind's block tables
    request: jax.Array,  # i32[T], each token's request row
    positions: jax.Array,  # i32[T]
    ratio: int,
) -> jax.Array:
    """The entries of the windows this step closes, each at its place in its request's
    store (the others dropped): one scatter into the stores, in place."""
    blocks, size = store.shape[1], store.shape[2]
    index = jnp.clip((positions + 1) // ratio - 1, 0)  # [T], the entry a closing token ends
    block = jnp.where(closes, table[request, index // size], blocks)  # (out of range: dropped)
    return store.at[layer, block, index % size].set(entries.astype(store.dtype), mode="drop")


def write_window(
    window: jax.Array,  # [L, NB, BS, D]
    layer: int,
    kv: jax.Array,  # [T, D], each token's K=V entry
    slot_mapping: jax.Array,  # i32[T], block * BS + offset
) -> jax.Array:
    size = window.shape[2]
    return window.at[layer, slot_mapping // size, slot_mapping % size].set(kv.astype(window.dtype))
