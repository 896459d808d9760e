"""Decode-step helpers shared by the roofline tools: a synthetic decode batch and the bytes a
step reads of the weights."""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxinfer.models.inputs import BatchInputs


def decode_batch(
    batch: int, context: int, block_size: int, vocab: int, max_blocks: int | None = None
) -> BatchInputs:
    """B requests of `context` tokens each, one new token apiece (random ids), on blocks 1..
    of the cache; block tables padded to `max_blocks` columns (default: just enough)."""
    blocks_per = -(-context // block_size)
    tables = np.zeros((batch, max_blocks or blocks_per), np.int32)
    tables[:, :blocks_per] = 1 + np.arange(batch * blocks_per).reshape(batch, blocks_per)
    last = context - 1
    rng = np.random.default_rng(0)
    return BatchInputs(
        token_ids=rng.integers(0, vocab, batch).astype(np.int32),
        positions=np.full(batch, last, np.int32),
        slot_mapping=tables[:, last // block_size] * block_size + last % block_size,
        block_tables=tables,
        seq_lens=np.full(batch, context, np.int32),
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        logits_indices=np.arange(batch, dtype=np.int32),
        num_seqs=np.array([batch], np.int32),
    )


def seconds_per_forward(runner, batch: BatchInputs, steps: int) -> float:
    """Seconds one `runner.forward(batch)` takes, over `steps` calls after two warm-up ones."""
    for _ in range(2):
        logits = runner.forward(batch)
    logits.block_until_ready()
    begin = time.perf_counter()
    for _ in range(steps):
        logits = runner.forward(batch)
    logits.block_until_ready()
    return (time.perf_counter() - begin) / steps


def _nbytes(a) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def read_bytes(tree) -> int:
    """Bytes a step reads of a parameter tree (or one weight): every array once (a GGUF block
    weight's blocks as they are)."""
    return sum(_nbytes(a) for a in jax.tree.leaves(tree))
