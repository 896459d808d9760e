"""DeepSeek-V4's attention (pallas_kernels/compressed_attention/reference.py) against numpy:
one softmax with each head's sink over the sliding window's K=V entries and the compressed
entries, all closed ones (HCA) or the indexer's picks (CSA), none for a sliding-only layer;
two requests in one flattened batch (a prefill chunk and a decode), their positions and
entries in shuffled blocks. The Pallas kernel the same way (interpreted), and lowered for
CUDA."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import gpu_lowering
from pallas_kernels.compressed_attention import kernel
from pallas_kernels.compressed_attention.reference import compressed_attention

IMPLEMENTATIONS = {
    "reference": compressed_attention,
    "pallas": functools.partial(kernel.compressed_attention, interpret=True),
}


def implementation_of(name: str, request):
    """The implementation `name`: the C++ kernel ("cpu", built once per session) or one of
    IMPLEMENTATIONS."""
    if name == "cpu":
        return request.getfixturevalue("cpu_compressed").compressed_attention
    return IMPLEMENTATIONS[name]


HEADS, DIM, WINDOW, RATIO, BLOCK = 4, 16, 8, 4, 4


def expected_attention(q, kv, entries, picks, sinks, position, scale):
    """One query at `position` of a request whose K=V entries are kv[:position + 1]."""
    keys = kv[max(0, position - WINDOW + 1) : position + 1]
    if entries is not None:
        closed = range((position + 1) // RATIO)
        chosen = [e for e in closed if picks is None or e in picks]
        keys = np.concatenate([keys, entries[chosen]])
    logits = np.einsum("hd,sd->hs", q, keys) * scale
    logits = np.concatenate([logits, sinks[:, None]], axis=1)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return probs[:, :-1] @ keys


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "cpu"])
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_attention_over_the_window_and_the_compressed_entries(kind, implementation, request):
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    lengths, steps = [32, 18], [12, 1]  # request 0: positions 20-31; request 1: 17
    num_blocks = 24
    kv_store = np.zeros((num_blocks, BLOCK, DIM))
    entry_store = np.zeros((num_blocks, BLOCK, DIM))
    order = rng.permutation(np.arange(1, num_blocks))
    tables, entry_tables, kvs, all_entries = [], [], [], []
    for length in lengths:
        kv = rng.normal(size=(length, DIM))
        entries = rng.normal(size=(length // RATIO, DIM))
        table, order = order[:8], order[8:]
        entry_table, order = order[:3], order[3:]
        for p in range(length):
            kv_store[table[p // BLOCK], p % BLOCK] = kv[p]
        for e in range(len(entries)):
            entry_store[entry_table[e // BLOCK], e % BLOCK] = entries[e]
        tables.append(table)
        entry_tables.append(entry_table)
        kvs.append(kv)
        all_entries.append(entries)
    positions = np.concatenate([np.arange(n - s, n) for n, s in zip(lengths, steps, strict=True)])
    q = rng.normal(size=(len(positions), HEADS, DIM))
    sinks = rng.normal(size=HEADS)
    picks = None
    if kind == "csa":
        picks = np.stack([rng.permutation(8)[:3] for _ in positions]).astype(np.int32)
        picks[0, 1] = -1  # (a query that found fewer to pick)
    scale = DIM**-0.5
    attend = jax.jit(
        implementation_of(implementation, request), static_argnames=("window", "ratio", "scale")
    )
    got = attend(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(kv_store, jnp.float32),
        jnp.asarray(np.stack(tables), jnp.int32),
        None if kind == "sliding" else jnp.asarray(entry_store, jnp.float32),
        None if kind == "sliding" else jnp.asarray(np.stack(entry_tables), jnp.int32),
        None if picks is None else jnp.asarray(picks),
        jnp.asarray(sinks, jnp.float32),
        jnp.asarray([0, steps[0], sum(steps)], jnp.int32),
        jnp.asarray(positions, jnp.int32),
        window=WINDOW,
        ratio=RATIO,
        scale=scale,
    )
    owners = [0] * steps[0] + [1] * steps[1]
    for t, (r, position) in enumerate(zip(owners, positions, strict=True)):
        entries = None if kind == "sliding" else all_entries[r]
        chosen = None if picks is None else set(picks[t].tolist())
        want = expected_attention(q[t], kvs[r], entries, chosen, sinks, position, scale)
        np.testing.assert_allclose(np.asarray(got[t]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
def test_pallas_kernel_lowers_for_cuda(kind):
    import jax.numpy as jnp

    tokens, requests = 5, 2
    args = [
        jnp.zeros((tokens, HEADS, DIM)),
        jnp.zeros((24, BLOCK, DIM)),
        jnp.zeros((requests, 8), jnp.int32),
        None if kind == "sliding" else jnp.zeros((24, BLOCK, DIM)),
        None if kind == "sliding" else jnp.zeros((requests, 3), jnp.int32),
        jnp.zeros((tokens, 3), jnp.int32) if kind == "csa" else None,
        jnp.zeros(HEADS),
        jnp.asarray([0, 4, 5], jnp.int32),
        jnp.zeros(tokens, jnp.int32),
    ]

    def attention(*arrays):
        return kernel.compressed_attention(*arrays, window=WINDOW, ratio=RATIO, scale=0.25)

    text = gpu_lowering.lower_for_gpu(attention, *args)
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
