"""Kernel-test helpers: attention batches of mixed lengths, the pairwise cases, tolerances,
jit and reference wrappers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

F32, BF16 = jnp.float32, jnp.bfloat16
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # max abs error; outputs are O(1)


# On CPU the kernels run through Pallas' interpreter; on a GPU (tools/gpu_check.sh) compiled.
INTERPRET = jax.default_backend() != "gpu"


def attention_batch(
    q_lens, context_lens, *, group, head_dim, block_size, dtype, num_kv_heads=2, seed=0
):
    """A flattened batch of the requests (q_lens[i] new tokens of a context_lens[i] context)
    plus 2 padding requests and 3 padding tokens, over a shuffled block pool."""
    rng = np.random.default_rng(seed)
    num_real = len(q_lens)
    num_reqs, num_tokens = num_real + 2, sum(q_lens) + 3
    max_blocks = max(-(-c // block_size) for c in context_lens) + 1
    num_blocks = 1 + sum(-(-c // block_size) for c in context_lens) + 3
    query_start_loc = np.full(num_reqs + 1, sum(q_lens), np.int32)
    query_start_loc[: num_real + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens = np.zeros(num_reqs, np.int32)
    seq_lens[:num_real] = context_lens
    block_tables = np.zeros((num_reqs, max_blocks), np.int32)
    free = rng.permutation(np.arange(1, num_blocks))
    used = 0
    for r, context in enumerate(context_lens):
        count = -(-context // block_size)
        block_tables[r, :count] = free[used : used + count]
        used += count
    num_heads = group * num_kv_heads
    q = rng.standard_normal((num_tokens, num_heads, head_dim))
    kv = rng.standard_normal((2, num_blocks, block_size, num_kv_heads, head_dim))
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(kv, dtype),
        jnp.asarray(block_tables),
        jnp.asarray(seq_lens),
        jnp.asarray(query_start_loc),
        jnp.asarray([num_real], np.int32),
    )


def mixed_lengths(block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, context_lens) of a mixed batch: decodes (1 token), a prefill chunk ending on a
    block boundary, a ragged chunk of a longer context and a whole prompt of exactly two
    blocks (attention_batch adds padding requests and tokens)."""
    q_lens = [1, block_size, 7, 2 * block_size, 1]
    context_lens = [1, 2 * block_size, 3 * block_size + 5, 2 * block_size, 4 * block_size + 3]
    return q_lens, context_lens


def jit(fn, **static):
    """fn jitted with its keyword arguments bound (one compile instead of op-by-op dispatch)."""
    return jax.jit(functools.partial(fn, **static))


def reference(fn, **static):
    """A reference jitted at the highest matmul precision: on recent GPUs float32 matmuls
    default to TF32, which would put the reference itself further from the exact result than
    the float32 tolerance."""
    jitted = jit(fn, **static)

    def run(*args):
        with jax.default_matmul_precision("highest"):
            return jitted(*args)

    return run


def assert_close(actual, expected, dtype):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.abs(actual - expected).max() <= TOLERANCE[dtype]


# Every pair of values of block size {16, 32, 64}, group {1, 3, 4, 8}, head dim {64, 128} and
# dtype occurs in some case (pairwise coverage: 12 cases instead of the 48 of the product,
# which took about two minutes interpreted on CPU; PAIRWISE_CASES is checked below).
PAIRWISE_CASES = [
    (16, 1, 128, F32),
    (16, 3, 64, F32),
    (16, 4, 64, F32),
    (16, 8, 64, BF16),
    (32, 1, 64, BF16),
    (32, 3, 128, BF16),
    (32, 4, 64, F32),
    (32, 8, 128, F32),
    (64, 1, 128, F32),
    (64, 3, 128, F32),
    (64, 4, 128, BF16),
    (64, 8, 64, BF16),
]


# Block size x group x head dim: every pair of {8, 16, 32} x {1, 3, 4, 8} x {16, 64, 128}.
ATTENTION_CASES = [
    (8, 1, 16),
    (8, 3, 64),
    (8, 4, 128),
    (8, 8, 16),
    (16, 1, 64),
    (16, 3, 128),
    (16, 4, 16),
    (16, 8, 64),
    (32, 1, 128),
    (32, 3, 16),
    (32, 4, 64),
    (32, 8, 128),
]


def many_decodes(group: int, num_kv_heads: int) -> tuple:
    """11 decodes of random contexts and a 24-token prefill chunk (attention_batch's args)."""
    rng = np.random.default_rng(1)
    context_lens = [int(c) for c in rng.integers(1, 180, size=11)] + [100]
    return attention_batch(
        [1] * 11 + [24],
        context_lens,
        group=group,
        head_dim=64,
        block_size=16,
        dtype=F32,
        num_kv_heads=num_kv_heads,
    )
