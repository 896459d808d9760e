"""Batch invariance of each kernel the batch-invariant mode runs: a row's output, bit for bit,
must not change when other rows are added, nor (attention) when its token is computed in a
prefill chunk rather than as a decode. Each check is first shown to catch a kernel that
splits its reduction by a count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers import invariant
from pallas_kernels.add_rms_norm.kernel import add_rms_norm
from pallas_kernels.fused_ffn.kernel import fused_ffn
from pallas_kernels.fused_ffn.reference import fused_ffn_reference
from pallas_kernels.matmul.kernel import matmul as pallas_matmul
from pallas_kernels.matmul.reference import matmul_reference
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention

pytestmark = [pytest.mark.slow, pytest.mark.invariance]

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 33, 64)


def changed_rows(fn, x: np.ndarray, counts=ROW_COUNTS) -> list[int]:
    """The row counts m at which fn(x[:m])'s row 0 or row m-1 differs, bitwise, from the row
    computed alone."""
    alone = {i: np.asarray(fn(x[i : i + 1]))[0] for i in {0, *[m - 1 for m in counts]}}
    bad = []
    for m in counts:
        out = np.asarray(fn(x[:m]))
        if not (np.array_equal(out[0], alone[0]) and np.array_equal(out[m - 1], alone[m - 1])):
            bad.append(m)
    return bad


def split_by_count_sum(x: jax.Array) -> jax.Array:  # [T, N] -> [T]
    """A row sum that splits each row into as many parts as there are rows (up to 8), then adds
    the parts: what a kernel choosing its split count from the batch does."""
    parts = min(8, x.shape[0])
    pad = -x.shape[1] % parts
    chunks = jnp.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], parts, -1)
    return jnp.sum(jax.lax.optimization_barrier(jnp.sum(chunks, axis=-1)), axis=-1)


def test_the_row_check_catches_a_reduction_split_by_count():
    x = np.random.default_rng(0).standard_normal((64, 576)).astype(np.float32)
    assert changed_rows(jax.jit(split_by_count_sum), x)  # caught
    assert changed_rows(jax.jit(invariant.tree_sum), x) == []


def test_invariant_reductions_match_numpy():
    # jitted, as the engine runs them (op by op, their many slices each compile on their own)
    tree_sum, cumsum, logsumexp = map(
        jax.jit, (invariant.tree_sum, invariant.cumsum, invariant.logsumexp)
    )
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 64, 576, 1000):
        x = rng.standard_normal((5, n)).astype(np.float32)
        np.testing.assert_allclose(tree_sum(x), x.astype(np.float64).sum(-1), rtol=1e-5)
        np.testing.assert_allclose(
            cumsum(x), np.cumsum(x.astype(np.float64), -1), rtol=1e-4, atol=1e-5
        )
        lse = np.log(np.exp(x.astype(np.float64)).sum(-1))
        np.testing.assert_allclose(logsumexp(x), lse, rtol=1e-5)
    masked = np.array([[-np.inf, -np.inf], [0.0, -np.inf]], np.float32)
    np.testing.assert_array_equal(logsumexp(masked), [-np.inf, 0.0])


def test_the_matmul_kernel_in_fixed_order_is_row_invariant(cpu_matmul):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((1536, 576)), jnp.float32)
    q = jnp.asarray(rng.integers(-127, 128, (1536, 576)), jnp.int8)
    scale = jnp.asarray(rng.random(1536) * 0.01, jnp.float32)
    # The default order (up to 3 rows streamed, 32 chains each) is caught ...
    assert changed_rows(jax.jit(lambda a: cpu_matmul(a, w)), x)
    # ... the fixed order is not, for float32 and int8 weights.
    fixed = functools.partial(cpu_matmul, fixed_order=True)
    assert changed_rows(jax.jit(lambda a: fixed(a, w)), x) == []
    assert changed_rows(jax.jit(lambda a: fixed(a, q, scale)), x) == []
    reference = x.astype(np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(fixed(jnp.asarray(x), w), reference, rtol=1e-4, atol=1e-3)


def test_the_pallas_matmul_is_row_invariant():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((576, 192)), jnp.float32)
    # XLA's dot, which picks its blocking from the whole shape, is caught ...
    assert changed_rows(jax.jit(lambda a: a @ w), x)
    # ... the Pallas kernel's fixed tiles are not.
    kernel = jax.jit(lambda a: pallas_matmul(a, w, interpret=True))
    assert changed_rows(kernel, x) == []
    with jax.default_matmul_precision("highest"):
        expected = matmul_reference(jnp.asarray(x), w)
    np.testing.assert_allclose(kernel(x), expected, rtol=2e-5, atol=2e-4)


def test_the_pallas_ffn_in_invariant_form_is_row_invariant():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    gate_up = jnp.asarray(rng.standard_normal((64, 2, 112)) / 8, jnp.float32)
    down = jnp.asarray(rng.standard_normal((112, 64)) / 10, jnp.float32)
    kernel = jax.jit(lambda a: fused_ffn(a, gate_up, down, interpret=True, batch_invariant=True))
    assert changed_rows(kernel, x) == []
    with jax.default_matmul_precision("highest"):
        expected = fused_ffn_reference(jnp.asarray(x), gate_up, down)
    np.testing.assert_allclose(kernel(x), expected, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("norm", ["invariant", "pallas_interpret"])
def test_norms_are_row_invariant(norm):
    rng = np.random.default_rng(3)
    x, residual = rng.standard_normal((2, 64, 576)).astype(np.float32)
    weight = jnp.asarray(rng.standard_normal(576), jnp.float32)
    kernel = (
        invariant.add_rms_norm
        if norm == "invariant"
        else functools.partial(add_rms_norm, interpret=True)
    )
    both = np.concatenate([x, residual], axis=1)  # rows carry x and the residual together

    def run(rows):
        normed, summed = kernel(rows[:, :576], rows[:, 576:], weight, eps=1e-5)
        return jnp.concatenate([normed, summed], axis=1)

    assert changed_rows(jax.jit(run), both) == []


# -- attention ----------------------------------------------------------------------------------

BLOCK_SIZE, KV_HEADS, GROUP, HEAD_DIM = 8, 2, 3, 64
NUM_BLOCKS = 160


class Pool:
    """One KV cache and the queries of several requests, each with its own blocks, from which
    batches of any of them are cut (the fixed request's blocks and rows never change)."""

    def __init__(self, seed: int = 4):
        self.rng = np.random.default_rng(seed)
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.kv = jnp.asarray(self.rng.standard_normal(shape), jnp.float32)
        self.free = list(self.rng.permutation(np.arange(1, NUM_BLOCKS)))

    def request(self, context: int, q_len: int) -> dict:
        """A request whose last q_len of `context` positions are this step's tokens."""
        blocks = [self.free.pop() for _ in range(-(-context // BLOCK_SIZE))]
        q = self.rng.standard_normal((q_len, KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)
        return dict(context=context, blocks=blocks, q=q)


def batch(requests: list[dict]) -> tuple:
    """The kernel's arguments for these requests, plus one padding request and 3 padding
    tokens (a bucket), as the engine builds them."""
    q = np.concatenate([r["q"] for r in requests] + [np.zeros((3, *requests[0]["q"].shape[1:]))])
    max_blocks = max(len(r["blocks"]) for r in requests) + 1
    tables = np.zeros((len(requests) + 1, max_blocks), np.int32)
    for i, r in enumerate(requests):
        tables[i, : len(r["blocks"])] = r["blocks"]
    lens = [len(r["q"]) for r in requests]
    starts = np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32)
    seq_lens = np.array([r["context"] for r in requests] + [0], np.int32)
    return (
        jnp.asarray(q, jnp.float32),
        tables,
        seq_lens,
        starts,
        np.array([len(requests)], np.int32),
    )


def attend(kernel, pool: Pool, requests: list[dict]) -> np.ndarray:
    q, tables, seq_lens, starts, num_seqs = batch(requests)
    out = kernel(q, pool.kv, tables, seq_lens, starts, num_seqs, sm_scale=HEAD_DIM**-0.5)
    return np.asarray(out)


def invariance_failures(kernel, seed: int = 4) -> list[str]:
    """Where the fixed request's rows change: beside other requests (decodes, prefill chunks,
    long contexts), and its prefill chunk's tokens against the same tokens as decodes."""
    pool = Pool(seed)
    fixed = pool.request(context=300, q_len=5)  # a prefill chunk at the end of a long context
    alone = attend(kernel, pool, [fixed])[:5]
    others = [
        pool.request(c, n) for c, n in [(1, 1), (40, 1), (90, 16), (200, 1), (35, 35), (160, 160)]
    ]
    failures = []
    for count in range(1, len(others) + 1):
        for where in (0, count):  # the fixed request first, or last
            requests = others[:count]
            requests = [*requests[:where], fixed, *requests[where:]]
            start = sum(len(r["q"]) for r in requests[:where])
            out = attend(kernel, pool, requests)[start : start + 5]
            if not np.array_equal(out, alone):
                failures.append(f"beside {count} others at {where}")
    for i in range(5):  # token i of the chunk as a decode of the first 296 + i positions
        decode = dict(context=296 + i, blocks=fixed["blocks"], q=fixed["q"][i : i + 1])
        for requests in ([decode], [others[2], decode]):
            row = sum(len(r["q"]) for r in requests[:-1])
            out = attend(kernel, pool, requests)[row]
            if not np.array_equal(out, alone[i]):
                failures.append(f"token {i} as a decode beside {len(requests) - 1}")
    return failures


def test_the_attention_check_catches_kv_splits_by_count():
    # The Pallas kernel's default splits a long context by a count chosen from the batch
    # (Flash-Decoding): caught.
    kernel = functools.partial(ragged_paged_attention, interpret=True)
    assert invariance_failures(jax.jit(kernel, static_argnames=("sm_scale",)))


@pytest.mark.parametrize("impl", ["cpu", "pallas_interpret"])
def test_attention_is_row_invariant(impl, cpu_attention):
    if impl == "cpu":
        kernel = cpu_attention
    else:
        kernel = functools.partial(ragged_paged_attention, interpret=True, batch_invariant=True)
    assert invariance_failures(jax.jit(kernel, static_argnames=("sm_scale",))) == []
