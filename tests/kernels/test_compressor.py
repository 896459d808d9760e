"""DeepSeek-V4's compressor (pallas_kernels/compressor/reference.py): windows of a request's
tokens pooled into compressed entries, HCA's one series and CSA's two overlapping ones.
numpy pools a whole sequence at once, and that pooling (with the RMSNorm and RoPE after it)
is HF transformers' DeepseekV4 compressors' output; the JAX reference gives the same entries
for requests whose tokens arrive over several steps (prefill chunks, decodes) side by side
in one flattened batch, each window's tokens carried across steps in its state slot; so does
the Pallas kernel (interpreted), and it lowers for CUDA."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from pallas_kernels import gpu_lowering
from pallas_kernels.compressor import kernel
from pallas_kernels.compressor.reference import (
    CompressorBatch,
    CompressorState,
    compress,
    ring_size,
)
from tests.support.deepseek_v4 import DIM, HIDDEN, ROPE, hf_config, norm_and_rope, pool_sequence


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_numpy_pooling_is_hugging_faces_compressor(kind):
    """HF's compressor on a 29-token sequence (stateless): numpy's pooled entries, after its
    RMSNorm and the interleaved RoPE of the trailing dims at each window's first position."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = hf_config()
    torch.manual_seed(0)
    compressor = (hf.DeepseekV4HCACompressor if kind == "hca" else hf.DeepseekV4CSACompressor)(
        config
    )
    with torch.no_grad():
        for parameter in compressor.parameters():
            parameter.normal_(0, 0.5)
    hidden = torch.randn(1, 29, HIDDEN)
    positions = torch.arange(29)[None]
    q_residual = torch.randn(1, 29, config.q_lora_rank)  # (the indexer's, not compared)
    with torch.no_grad():
        expected = compressor(hidden, q_residual, positions, None, 0)[0][0, 0].double().numpy()
        kv = compressor.kv_proj(hidden)[0].double().numpy()
        gate = compressor.gate_proj(hidden)[0].double().numpy()
    bias = compressor.position_bias.detach().double().numpy()
    entries = pool_sequence(kv, gate, bias, overlap=kind == "csa")
    entries = norm_and_rope(entries, compressor.kv_norm, bias.shape[0], config, ROPE)
    ratio = bias.shape[0]
    assert entries.shape == expected.shape == (29 // ratio, DIM)
    np.testing.assert_allclose(entries, expected, rtol=1e-5, atol=1e-5)


IMPLEMENTATIONS = {
    "reference": compress,
    "pallas": functools.partial(kernel.compress, interpret=True),
}


@pytest.mark.parametrize("implementation", [*IMPLEMENTATIONS, "cpu"])
@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_windows_carried_across_steps_give_the_whole_sequences_entries(
    kind, implementation, request
):
    """Three requests (37, 23 and 9 tokens) in steps of mixed chunks and decodes, each in its
    own state slot: every token that closes a window gets numpy's entry for that window, the
    others zeros. Some steps run rejected proposals past a request's tokens (other values at
    the next positions, across window ends), as a speculative step's verify does: the next
    step goes on from the accepted tokens, and the entries are still the whole sequence's."""
    import jax.numpy as jnp

    overlap = kind == "csa"
    ratio = 4 if overlap else 8
    features = 2 * DIM if overlap else DIM
    rng = np.random.default_rng(1)
    lengths = {0: 37, 1: 23, 2: 9}
    rows = {0: 2, 1: 0, 2: 3}  # each request's state slot
    kv = {r: rng.normal(size=(n, features)) for r, n in lengths.items()}
    gate = {r: rng.normal(size=(n, features)) for r, n in lengths.items()}
    bias = rng.normal(size=(ratio, features))
    # Each step: (request, tokens[, rejected proposals after them]) in batch order; chunks
    # end mid-window and across windows, and so do the rejected proposals.
    steps = [
        [(0, 6), (1, 3, 4)],
        [(1, 13), (0, 1, 5), (2, 5)],
        [(0, 11), (2, 1, 3)],
        [(2, 1), (1, 1, 2), (0, 17)],
        [(0, 1, 5), (1, 5), (2, 2)],
        [(0, 1), (1, 1)],
    ]
    num_tokens, num_reqs, num_slots = 32, 4, 5
    ring = ring_size(ratio, overlap, spare=5)
    state = CompressorState(
        buffer_kv=jnp.full((num_slots, ring, features), 7.0),  # (never read unwritten)
        buffer_gate=jnp.full((num_slots, ring, features), 7.0),
    )
    done = dict.fromkeys(lengths, 0)
    found = {r: {} for r in lengths}  # window -> entry
    pool = IMPLEMENTATIONS.get(implementation)
    if implementation == "cpu":  # the C++ kernel, built once per session
        pool = request.getfixturevalue("cpu_compressed").compressor
    pool = jax.jit(pool, static_argnames="overlap")
    for step in steps:
        step_kv = np.zeros((num_tokens, features))
        step_gate = np.zeros((num_tokens, features))
        positions = np.zeros(num_tokens, np.int32)
        starts = np.zeros(num_reqs + 1, np.int32)
        state_rows = np.full(num_reqs, num_slots - 1, np.int32)  # (padding: the last slot)
        owners = []
        cursor = 0
        for index, (r, count, *rejected) in enumerate(step):
            span = slice(done[r], done[r] + count)
            step_kv[cursor : cursor + count] = kv[r][span]
            step_gate[cursor : cursor + count] = gate[r][span]
            extra = rejected[0] if rejected else 0  # other values at the next positions
            step_kv[cursor + count : cursor + count + extra] = rng.normal(size=(extra, features))
            step_gate[cursor + count : cursor + count + extra] = rng.normal(size=(extra, features))
            positions[cursor : cursor + count + extra] = np.arange(done[r], done[r] + count + extra)
            owners += [r] * count + [None] * extra
            cursor += count + extra
            starts[index + 1] = cursor
            state_rows[index] = rows[r]
            done[r] += count
        starts[len(step) + 1 :] = cursor
        batch = CompressorBatch(starts, positions, state_rows, np.array([len(step)], np.int32))
        entries, closes, state = pool(
            jnp.asarray(step_kv, jnp.float32),
            jnp.asarray(step_gate, jnp.float32),
            jnp.asarray(bias, jnp.float32),
            state,
            batch,
            overlap=overlap,
        )
        for t in np.flatnonzero(np.asarray(closes)):
            if owners[t] is not None:  # (a rejected proposal's entry is dropped)
                found[owners[t]][(positions[t] + 1) // ratio - 1] = np.asarray(entries[t])
        assert not np.asarray(entries)[~np.asarray(closes)].any()
    assert done == lengths
    for r in lengths:
        expected = pool_sequence(kv[r], gate[r], bias, overlap)
        assert sorted(found[r]) == list(range(len(expected)))
        got = np.asarray([found[r][w] for w in range(len(expected))])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_pallas_kernel_lowers_for_cuda(kind):
    import jax.numpy as jnp

    overlap = kind == "csa"
    ratio, slots, tokens = (4 if overlap else 128), 3, 6
    features = 2 * DIM if overlap else DIM
    ring = ring_size(ratio, overlap, spare=8)
    state = CompressorState(jnp.zeros((slots, ring, features)), jnp.zeros((slots, ring, features)))
    batch = CompressorBatch(
        jnp.asarray([0, 5, 6], jnp.int32),
        jnp.zeros(tokens, jnp.int32),
        jnp.zeros(2, jnp.int32),
        jnp.ones(1, jnp.int32),
    )
    args = [jnp.zeros((tokens, features)), jnp.zeros((tokens, features))]
    args += [jnp.zeros((ratio, features)), state, batch]

    def pool(*arrays):
        return kernel.compress(*arrays, overlap=overlap)

    text = gpu_lowering.lower_for_gpu(pool, *args)
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
