"""DeepSeek-V4's C++ attention and Lightning Indexer (cpu_kernels/compressed_attention) against
their pure-JAX references on a mixed batch of three requests (a prefill chunk, decodes, one
request with nothing closed yet), shuffled blocks and padding tokens: the same picks in the
same order (ties to the lower entry), the same attention within float32 rounding, zeros and no
picks for padding tokens, a layer of a stack read in place, and wrong inputs refused. The
numpy and HF comparisons of both are in test_compressed_attention.py and
test_lightning_indexer.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.compressed_attention.reference import compressed_attention
from pallas_kernels.compressor.reference import compress
from pallas_kernels.lightning_indexer.reference import indexer_topk

BLOCK, DIM, HEADS, INDEX_HEADS, INDEX_DIM, RATIO = 4, 24, 3, 4, 12, 4
STEPS = [(40, 9), (70, 1), (2, 1)]  # (position after the step, tokens in it) per request
PAD = 5  # padding tokens after the real ones
INDEXER_STATIC = ("ratio", "topk", "scale")
ATTENTION_STATIC = ("window", "ratio", "scale")
# the references, compiled (op by op they take seconds)
reference_picks = jax.jit(indexer_topk, static_argnames=INDEXER_STATIC)
reference_attention = jax.jit(compressed_attention, static_argnames=ATTENTION_STATIC)
reference_compress = jax.jit(compress, static_argnames="overlap")


def batch(rng):
    """(block_table [R, 20], entry_table [R, 6], query_start_loc, positions) over shuffled
    blocks, each request's own."""
    window_blocks = rng.permutation(np.arange(1, 64))[:60].reshape(3, 20)
    entry_blocks = rng.permutation(np.arange(1, 20))[:18].reshape(3, 6)
    positions = np.concatenate([np.arange(end - n, end) for end, n in STEPS] + [np.zeros(PAD)])
    starts = np.cumsum([0] + [n for _, n in STEPS])
    return (
        jnp.asarray(window_blocks, jnp.int32),
        jnp.asarray(entry_blocks, jnp.int32),
        jnp.asarray(starts, jnp.int32),
        jnp.asarray(positions, jnp.int32),
    )


def real_tokens() -> int:
    return sum(n for _, n in STEPS)


@pytest.mark.parametrize("topk", [3, 100])
def test_picks_equal_the_references(cpu_compressed, topk):
    rng = np.random.default_rng(topk)
    _, entry_table, starts, positions = batch(rng)
    tokens = len(positions)
    keys = jnp.asarray(rng.normal(size=(20, BLOCK, INDEX_DIM)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(tokens, INDEX_HEADS, INDEX_DIM)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(tokens, INDEX_HEADS)), jnp.float32)
    args = (q, weights, keys, entry_table, starts, positions)
    options = dict(ratio=RATIO, topk=topk, scale=INDEX_DIM**-0.5)
    want = np.asarray(reference_picks(*args, **options))
    got = np.asarray(
        jax.jit(cpu_compressed.lightning_indexer, static_argnames=INDEXER_STATIC)(*args, **options)
    )
    assert got.shape == want.shape == (tokens, min(topk, 6 * BLOCK))
    real = real_tokens()
    np.testing.assert_array_equal(got[:real], want[:real])
    assert (got[real:] == -1).all()
    # the request at position 1 sees nothing yet; the one at 69 as many as it may pick
    assert (got[real - 1] == -1).all()
    assert (got[real - 2] >= 0).sum() == min(topk, 70 // RATIO)


def test_equal_scores_pick_the_lower_entries_first(cpu_compressed):
    rng = np.random.default_rng(0)
    _, entry_table, starts, positions = batch(rng)
    tokens = len(positions)
    keys = jnp.zeros((20, BLOCK, INDEX_DIM), jnp.float32)  # every score 0
    q = jnp.asarray(rng.normal(size=(tokens, INDEX_HEADS, INDEX_DIM)), jnp.float32)
    weights = jnp.ones((tokens, INDEX_HEADS), jnp.float32)
    args = (q, weights, keys, entry_table, starts, positions)
    options = dict(ratio=RATIO, topk=5, scale=1.0)
    got = np.asarray(cpu_compressed.lightning_indexer(*args, **options))
    np.testing.assert_array_equal(got[0], np.arange(5))  # position 31: 8 entries closed
    np.testing.assert_array_equal(
        got[: real_tokens()], np.asarray(reference_picks(*args, **options))[: real_tokens()]
    )


# (a window of 1000: more than a request's blocks hold)
@pytest.mark.parametrize(("kind", "window"), [("sliding", 1000), ("hca", 6), ("csa", 6)])
def test_attention_equals_the_reference(cpu_compressed, kind, window):
    rng = np.random.default_rng(window)
    table, entry_table, starts, positions = batch(rng)
    tokens = len(positions)
    q = jnp.asarray(rng.normal(size=(tokens, HEADS, DIM)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(64, BLOCK, DIM)), jnp.float32)
    entries = jnp.asarray(rng.normal(size=(20, BLOCK, DIM)), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=HEADS), jnp.float32)
    picks = None
    if kind == "csa":  # some out of what a token sees, some -1
        picks = jnp.asarray(rng.integers(-1, 24, size=(tokens, 6)), jnp.int32)
    args = (
        q, kv, table, None if kind == "sliding" else entries,
        None if kind == "sliding" else entry_table, picks, sinks, starts, positions,
    )  # fmt: skip
    options = dict(window=window, ratio=RATIO, scale=DIM**-0.5)
    want = np.asarray(reference_attention(*args, **options))
    got = np.asarray(
        jax.jit(cpu_compressed.compressed_attention, static_argnames=ATTENTION_STATIC)(
            *args, **options
        )
    )
    real = real_tokens()
    np.testing.assert_allclose(got[:real], want[:real], rtol=2e-5, atol=2e-6)
    assert (got[real:] == 0).all()


def test_wrong_inputs_are_refused(cpu_compressed):
    rng = np.random.default_rng(0)
    _, entry_table, starts, positions = batch(rng)
    tokens = len(positions)
    q = jnp.zeros((tokens, INDEX_HEADS, INDEX_DIM), jnp.bfloat16)
    weights = jnp.zeros((tokens, INDEX_HEADS), jnp.float32)
    keys = jnp.zeros((20, BLOCK, INDEX_DIM), jnp.float32)
    with pytest.raises(TypeError, match="float32 q"):
        cpu_compressed.lightning_indexer(
            q, weights, keys, entry_table, starts, positions, ratio=RATIO, topk=4, scale=1.0
        )
    backwards = starts.at[1].set(12)  # past the next request's start
    with pytest.raises(Exception, match="query_start_loc out of order"):
        cpu_compressed.lightning_indexer(
            q.astype(jnp.float32), weights, keys, entry_table, backwards, positions,
            ratio=RATIO, topk=4, scale=1.0,
        )  # fmt: skip


def test_a_layer_of_a_stack_is_read_in_place(cpu_compressed):
    """The stores as stacks over layers with the layer to read (traced, as under the model's
    scan): the same as the reference given that layer alone."""
    rng = np.random.default_rng(1)
    table, entry_table, starts, positions = batch(rng)
    tokens = len(positions)
    kv = jnp.asarray(rng.normal(size=(3, 64, BLOCK, DIM)), jnp.float32)
    entries = jnp.asarray(rng.normal(size=(2, 20, BLOCK, DIM)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(2, 20, BLOCK, INDEX_DIM)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(tokens, HEADS, DIM)), jnp.float32)
    iq = jnp.asarray(rng.normal(size=(tokens, INDEX_HEADS, INDEX_DIM)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(tokens, INDEX_HEADS)), jnp.float32)
    sinks = jnp.asarray(rng.normal(size=HEADS), jnp.float32)

    @jax.jit
    def native(layer, entry_layer):
        picks = cpu_compressed.lightning_indexer(
            iq, weights, keys, entry_table, starts, positions,
            ratio=RATIO, topk=5, scale=0.5, layer=entry_layer,
        )  # fmt: skip
        out = cpu_compressed.compressed_attention(
            q, kv, table, entries, entry_table, picks, sinks, starts, positions,
            window=6, ratio=RATIO, scale=0.25, kv_layer=layer, entry_layer=entry_layer,
        )  # fmt: skip
        return picks, out

    real = real_tokens()
    for layer, entry_layer in [(2, 1), (0, 0)]:
        picks, out = native(jnp.int32(layer), jnp.int32(entry_layer))
        want_picks = reference_picks(
            iq, weights, keys[entry_layer], entry_table, starts, positions,
            ratio=RATIO, topk=5, scale=0.5,
        )  # fmt: skip
        want = reference_attention(
            q, kv[layer], table, entries[entry_layer], entry_table, want_picks, sinks, starts,
            positions, window=6, ratio=RATIO, scale=0.25,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(picks)[:real], np.asarray(want_picks)[:real])
        np.testing.assert_allclose(
            np.asarray(out)[:real], np.asarray(want)[:real], rtol=2e-5, atol=2e-6
        )
    with pytest.raises(Exception, match="layer out of range"):
        native(jnp.int32(3), jnp.int32(0))


@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_the_compressor_updates_its_layer_of_the_stack_as_the_reference(cpu_compressed, overlap):
    """A step of a prefill chunk closing windows, decodes (one closing, one inside a window)
    and padding, on layer 1 of a stack of 3 holding random state: the same entries, and the
    same stack after the step (the other layers and slots untouched), as the reference."""
    from pallas_kernels.compressor.reference import CompressorBatch, CompressorState, ring_size

    ratio = RATIO if overlap else 8
    features = 2 * DIM if overlap else DIM
    rng = np.random.default_rng(2)
    starts = np.asarray([0, 11, 12, 13, 13], np.int32)  # 3 requests, one padded
    positions = np.concatenate([np.arange(5, 16), [23], [17], np.zeros(PAD)]).astype(np.int32)
    batch = CompressorBatch(
        jnp.asarray(starts), jnp.asarray(positions), jnp.asarray([2, 0, 3, 4], jnp.int32),
        jnp.asarray([3], jnp.int32),
    )  # fmt: skip
    tokens = len(positions)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    ring = ring_size(ratio, overlap, spare=3)  # (a ring with room for proposals)
    state = CompressorState(normal(3, 5, ring, features), normal(3, 5, ring, features))
    args = (normal(tokens, features), normal(tokens, features), normal(ratio, features))
    want = reference_compress(*args, state, batch, overlap=overlap, layer=jnp.int32(1))
    got = jax.jit(cpu_compressed.compressor, static_argnames="overlap")(
        *args, state, batch, overlap=overlap, layer=jnp.int32(1)
    )
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert np.asarray(got[1]).sum() >= 2  # (windows close in the chunk and in a decode)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    for name, a, b in zip(CompressorState._fields, got[2], want[2], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
