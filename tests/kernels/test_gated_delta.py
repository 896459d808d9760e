"""The gated delta rule's two pure-JAX forms (pallas_kernels/gated_delta) over a flattened
mixed batch, against HF transformers' own torch implementations (Qwen3-Next's recurrent and
chunked rules) run request by request: a fresh prefill longer than several chunks, a
prefill's next chunk and decodes carrying their states, padding requests and tokens; more
value heads than key heads."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from pallas_kernels.gated_delta.reference import (
    StateBatch,
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_reference,
)

# (tokens of each real request, starts fresh)
REQUESTS = [(37, True), (1, False), (9, False), (1, True), (20, False)]
HK, HV, DK, DV, SLOTS = 2, 4, 16, 8, 7


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths = [n for n, _ in REQUESTS]
    total = sum(lengths) + 3  # padding tokens
    q = rng.standard_normal((total, HK, DK)).astype(np.float32)
    k = rng.standard_normal((total, HK, DK)).astype(np.float32)
    v = rng.standard_normal((total, HV, DV)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((total, HV)))).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.standard_normal((total, HV))))).astype(np.float32)
    states = rng.standard_normal((SLOTS, HV, DK, DV)).astype(np.float32) * 0.5
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    query_start_loc = np.concatenate([starts, [starts[-1]] * 2]).astype(np.int32)  # 2 padding
    slots = np.asarray([5, 0, 3, 6, 1, 2, 4], np.int32)
    fresh = np.asarray([f for _, f in REQUESTS] + [False, False])
    num_seqs = np.asarray([len(REQUESTS)], np.int32)
    return q, k, v, g, beta, states, StateBatch(query_start_loc, slots, fresh, num_seqs)


def _expected(batch):
    """HF's recurrent rule, one request at a time, from its slot's state (or zeros)."""
    q, k, v, g, beta, states, where = batch
    qsl, slots, fresh, num_seqs = (
        where.query_start_loc,
        where.state_slots,
        where.fresh,
        where.num_seqs,
    )
    out = np.zeros_like(v)
    final = states.copy()
    for r in range(num_seqs[0]):
        a, b = qsl[r], qsl[r + 1]
        initial = torch.zeros(1, HV, DK, DV) if fresh[r] else torch.tensor(states[slots[r]][None])
        o, state = hf.torch_recurrent_gated_delta_rule(
            *(torch.tensor(x[a:b][None]) for x in (q, k, v, g, beta)),
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        out[a:b] = o[0].numpy()
        final[slots[r]] = state[0].numpy()
    return out, final


@pytest.mark.parametrize(
    "form",
    [
        gated_delta_recurrent,
        functools.partial(gated_delta_chunked, chunk=16),
        gated_delta_reference,
    ],
    ids=["recurrent", "chunked", "reference"],
)
def test_forms_match_hf_request_by_request(form):
    batch = _batch()
    expected_out, expected_states = _expected(batch)
    out, states = jax.jit(form)(*batch)
    np.testing.assert_allclose(out, expected_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(states, expected_states, rtol=1e-4, atol=1e-4)
    assert not np.asarray(out)[-3:].any()  # padding tokens


def test_reference_takes_the_recurrent_form_for_a_decode_step():
    """The kind's reference on a step of one token per request: the recurrent form's bits."""
    q, k, v, g, beta, states, _ = _batch(seed=5)
    qsl = np.arange(5, dtype=np.int32)  # four requests of one token each
    batch = StateBatch(qsl, np.asarray([3, 1, 0, 6], np.int32), np.zeros(4, bool), np.full(1, 4))
    args = (q[:4], k[:4], v[:4], g[:4], beta[:4], states, batch)
    recurrent = jax.jit(gated_delta_recurrent)(*args)
    for ours, theirs in zip(jax.jit(gated_delta_reference)(*args), recurrent, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_chunked_matches_hf_chunked_rule_on_one_long_sequence():
    """HF's chunked rule itself (chunks of 16) on a fresh 30-token sequence."""
    q, k, v, g, beta, *_ = _batch(seed=3)
    length = 30
    o, state = hf.torch_chunk_gated_delta_rule(
        *(torch.tensor(x[:length][None]) for x in (q, k, v, g, beta)),
        chunk_size=16,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    states = np.zeros((1, HV, DK, DV), np.float32)
    qsl = np.asarray([0, length], np.int32)
    ours, final = jax.jit(functools.partial(gated_delta_chunked, chunk=16))(
        *(x[:length] for x in (q, k, v, g, beta)),
        states,
        StateBatch(qsl, np.zeros(1, np.int32), np.ones(1, bool), np.ones(1, np.int32)),
    )
    np.testing.assert_allclose(ours, o[0].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final[0], state[0].numpy(), rtol=1e-4, atol=1e-4)


def test_causal_conv1d_continues_each_request_from_its_state():
    """Against torch's conv1d (as HF's layers run it: depthwise, padding K - 1, SiLU) over
    each request's whole sequence: the inputs before this step held in its slot (or none for
    a fresh request), a request shorter than the kernel among them."""
    from pallas_kernels.gated_delta.conv import causal_conv1d

    rng = np.random.default_rng(2)
    channels, width = 6, 4
    history = {0: 0, 1: 5, 2: 2, 3: 0, 4: 9}  # earlier inputs of each request (0: fresh)
    lengths = [7, 1, 2, 1, 5]
    slots = np.asarray([3, 0, 5, 1, 2, 4, 6], np.int32)
    total = sum(lengths) + 2
    x = rng.standard_normal((total, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, width)).astype(np.float32)
    states = rng.standard_normal((7, channels, width - 1)).astype(np.float32)
    earlier = {r: rng.standard_normal((n, channels)).astype(np.float32) for r, n in history.items()}
    for r, past in earlier.items():  # the slot holds the last K - 1 earlier inputs (zeros first)
        padded = np.concatenate([np.zeros((width - 1, channels), np.float32), past])
        if history[r]:
            states[slots[r]] = padded[-(width - 1) :].T
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    qsl = np.concatenate([starts, [starts[-1]] * 2]).astype(np.int32)
    fresh = np.asarray([history[r] == 0 for r in range(5)] + [False, False])
    where = StateBatch(qsl, slots, fresh, np.asarray([5], np.int32))
    y, new_states = jax.jit(causal_conv1d)(x, weight, states, where)
    conv = torch.nn.Conv1d(
        channels, channels, width, groups=channels, padding=width - 1, bias=False
    )
    conv.weight.data = torch.tensor(weight[:, None, :])
    for r, n in enumerate(lengths):
        sequence = np.concatenate([earlier[r], x[starts[r] : starts[r] + n]])
        full = torch.nn.functional.silu(conv(torch.tensor(sequence.T[None]))[..., : len(sequence)])
        np.testing.assert_allclose(
            np.asarray(y)[starts[r] : starts[r] + n], full[0, :, -n:].detach().numpy().T, atol=1e-5
        )
        padded = np.concatenate([np.zeros((width - 1, channels), np.float32), sequence])
        np.testing.assert_allclose(new_states[slots[r]], padded[-(width - 1) :].T, atol=1e-6)
    assert not np.asarray(y)[-2:].any()
    np.testing.assert_array_equal(new_states[slots[5:]], states[slots[5:]])  # padding requests


@pytest.mark.slow  # (and the entry's test below, which interprets both kernels)
def test_pallas_recurrent_kernel_interpreted_matches_the_reference():
    from pallas_kernels.gated_delta.kernel import gated_delta_recurrent as pallas_recurrent

    batch = _batch(seed=4)
    expected_out, expected_states = gated_delta_recurrent(*batch)
    out, states = jax.jit(functools.partial(pallas_recurrent, interpret=True))(*batch)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(states, expected_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 64], ids=["recurrent", "with-chunked"])
def test_pallas_kernels_lower_for_the_gpu(chunk):
    """The kind's Pallas entry lowers for CUDA: the recurrent kernel alone (chunk 0), or both
    kernels behind its decode-or-prefill switch."""
    from pallas_kernels import gpu_lowering
    from pallas_kernels.gated_delta.kernel import gated_delta

    tokens, requests = 64, 16
    args = (
        np.zeros((tokens, 16, 128), np.float32),
        np.zeros((tokens, 16, 128), np.float32),
        np.zeros((tokens, 32, 128), np.float32),
        np.zeros((tokens, 32), np.float32),
        np.zeros((tokens, 32), np.float32),
        np.zeros((requests + 1, 32, 128, 128), np.float32),
        StateBatch(
            np.zeros(requests + 1, np.int32),
            np.zeros(requests, np.int32),
            np.zeros(requests, bool),
            np.zeros(1, np.int32),
        ),
    )
    text = gpu_lowering.lower_for_gpu(functools.partial(gated_delta, chunk=chunk), *args)
    calls = gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call())
    assert calls == (1 if chunk == 0 else 2)


@pytest.mark.slow
def test_pallas_entry_switches_forms_like_the_reference():
    """The Pallas entry (interpreted) over a batch with a prefill and over a decode-only
    batch, against the recurrent reference."""
    from pallas_kernels.gated_delta.kernel import gated_delta

    kernel = jax.jit(functools.partial(gated_delta, chunk=16, interpret=True))
    q, k, v, g, beta, states, batch = _batch(seed=8)
    decodes = StateBatch(
        np.asarray([0, 1, 2], np.int32),
        batch.state_slots[:2],
        batch.fresh[:2],
        batch.num_seqs * 0 + 2,
    )
    for where in (batch, decodes):
        args = (q, k, v, g, beta, states, where)
        expected_out, expected_states = gated_delta_recurrent(*args)
        out, final = kernel(*args)
        np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(final, expected_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 16, 64], ids=["recurrent", "chunks-16", "chunks-64"])
def test_cpu_kernel_matches_the_reference(cpu_kernel_dir, chunk):
    """Both of the C++ kernel's forms: chunk 0 walks every token, else a request's several
    tokens go in chunks (several full ones and a shorter last one for the 37-token prefill)."""
    from cpu_kernels.gated_delta.kernel import load_gated_delta

    kernel = functools.partial(load_gated_delta(cpu_kernel_dir), chunk=chunk)
    batch = _batch(seed=5)
    expected_out, expected_states = gated_delta_recurrent(*batch)
    out, states = jax.jit(kernel)(*batch)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(states, expected_states, rtol=1e-5, atol=1e-5)


def test_cpu_kernel_chunked_on_wide_heads(cpu_kernel_dir):
    """Head dims that fill the kernel's 16-column register blocks (48 = 3 blocks) and chunks
    whose rows are not a multiple of its 4-row blocks (70 tokens: 64 + 6), from a carried
    state, against the recurrent reference."""
    from cpu_kernels.gated_delta.kernel import load_gated_delta

    rng = np.random.default_rng(11)
    tokens, hk, hv, dim = 75, 1, 2, 48
    q, k = (rng.standard_normal((tokens, hk, dim)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((tokens, hv, dim)).astype(np.float32)
    g = (-np.log1p(np.exp(rng.standard_normal((tokens, hv)))) * 0.2).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((tokens, hv))))).astype(np.float32)
    states = (rng.standard_normal((3, hv, dim, dim)) * 0.5).astype(np.float32)
    batch = StateBatch(
        np.asarray([0, 70, 71, 75], np.int32),
        np.asarray([2, 0, 1], np.int32),
        np.asarray([False, False, True]),
        np.asarray([3], np.int32),
    )
    args = (q, k, v, g, beta, states, batch)
    expected_out, expected_states = gated_delta_recurrent(*args)
    out, final = jax.jit(load_gated_delta(cpu_kernel_dir))(*args)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(final, expected_states, rtol=1e-5, atol=2e-5)


def test_pallas_chunked_kernel_interpreted_matches_the_reference():
    """Chunks of 16 over the batch's 37- and 20-token requests (several chunks and a shorter
    last one, from zeros and from a carried state), beside decodes and padding."""
    from pallas_kernels.gated_delta.chunked import gated_delta_chunked as pallas_chunked

    batch = _batch(seed=6)
    expected_out, expected_states = gated_delta_recurrent(*batch)
    kernel = functools.partial(pallas_chunked, chunk=16, interpret=True)
    out, states = jax.jit(kernel)(*batch)
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(states, expected_states, rtol=1e-5, atol=1e-5)
