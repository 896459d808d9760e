"""Random inputs shared by the kernel benchmarks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def attention_inputs(cfg, q_lens, context_lens, dtype, block_size: int, seed: int = 0):
    """(q, kv, block_tables, seq_lens, query_start_loc, num_seqs) for ragged paged attention:
    requests of `q_lens` new tokens at `context_lens`, their blocks scattered over the cache."""
    rng = np.random.default_rng(seed)
    blocks_per = [-(-c // block_size) for c in context_lens]
    num_blocks = 1 + sum(blocks_per)
    tables = np.zeros((len(q_lens), max(blocks_per)), np.int32)
    free = rng.permutation(np.arange(1, num_blocks))
    used = 0
    for r, count in enumerate(blocks_per):
        tables[r, :count] = free[used : used + count]
        used += count
    key_q, key_kv = jax.random.split(jax.random.key(seed))
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = jax.random.normal(key_q, (sum(q_lens), heads, head_dim), dtype)
    kv = jax.random.normal(key_kv, (2, num_blocks, block_size, kv_heads, head_dim), dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (
        q,
        kv,
        jnp.asarray(tables),
        jnp.asarray(context_lens, jnp.int32),
        jnp.asarray(starts),
        jnp.asarray([len(q_lens)], jnp.int32),
    )
