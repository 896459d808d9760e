"""Every Pallas kernel, run through Pallas' interpreter on CPU, against its pure-JAX reference;
and every kernel lowered for CUDA (no GPU needed), so one that would not lower fails here."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_lowering
from pallas_kernels.add_rms_norm.kernel import add_rms_norm
from pallas_kernels.add_rms_norm.reference import add_rms_norm_reference
from pallas_kernels.fused_ffn.kernel import fused_ffn
from pallas_kernels.fused_ffn.reference import fused_ffn_reference
from pallas_kernels.matmul.kernel import matmul as pallas_matmul
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.support.kernels import (
    BF16,
    F32,
    INTERPRET,
    PAIRWISE_CASES,
    assert_close,
    attention_batch,
    jit,
    mixed_lengths,
    reference,
)
from tests.support.lanes import sweep


def test_attention_cases_cover_every_pair_of_values():
    values = [[16, 32, 64], [1, 3, 4, 8], [64, 128], [F32, BF16]]
    for a, b in itertools.combinations(range(4), 2):
        pairs = {(case[a], case[b]) for case in PAIRWISE_CASES}
        assert pairs == set(itertools.product(values[a], values[b])), (a, b)


@pytest.mark.parametrize("block_size,group,head_dim,dtype", sweep(cases=PAIRWISE_CASES))
def test_attention_matches_reference(block_size, group, head_dim, dtype):
    q_lens, context_lens = mixed_lengths(block_size)
    args = attention_batch(
        q_lens, context_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    scale = head_dim**-0.5
    out = jit(ragged_paged_attention, sm_scale=scale, interpret=INTERPRET)(*args)
    expected = reference(ragged_paged_attention_reference, sm_scale=scale)(*args)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, expected, dtype)
    assert not np.asarray(out[sum(q_lens) :], np.float32).any()  # padding tokens: zeros


@pytest.mark.parametrize("num_kv_splits,sliding_window", sweep([2, 5], [None, 20]))
def test_attention_kv_splits_and_sliding_window(num_kv_splits, sliding_window):
    """Flash-Decoding (kv splits merged by log-sum-exp) and a sliding window, on long
    contexts where some splits are empty for some requests."""
    args = attention_batch(
        [1, 1, 3, 9],
        [150, 17, 96, 200],
        group=3,
        head_dim=64,
        block_size=16,
        dtype=jnp.float32,
    )
    kwargs = dict(sm_scale=0.125, sliding_window=sliding_window)
    out = jit(ragged_paged_attention, interpret=INTERPRET, num_kv_splits=num_kv_splits, **kwargs)
    assert_close(
        out(*args), reference(ragged_paged_attention_reference, **kwargs)(*args), jnp.float32
    )


def test_attention_reads_one_layer_of_the_whole_cache():
    q, kv, *rest = attention_batch(
        [4, 1], [20, 33], group=4, head_dim=64, block_size=16, dtype=jnp.float32
    )
    stacked = jnp.stack([kv * 0.5, kv, kv * 2.0])  # [L, 2, NB, BS, K, D]
    out = jit(ragged_paged_attention, sm_scale=0.1, interpret=INTERPRET)(
        q, stacked, *rest, layer=jnp.int32(2)
    )
    expected = reference(ragged_paged_attention_reference, sm_scale=0.1)(q, kv * 2.0, *rest)
    assert_close(out, expected, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_tokens,hidden,intermediate", [(1, 576, 1536), (37, 64, 112)])
def test_fused_ffn_matches_reference(num_tokens, hidden, intermediate, dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype)
    gate_up = jnp.asarray(rng.standard_normal((hidden, 2, intermediate)) / hidden**0.5, dtype)
    down = jnp.asarray(rng.standard_normal((intermediate, hidden)) / intermediate**0.5, dtype)
    out = jit(fused_ffn, interpret=INTERPRET)(x, gate_up, down)
    expected = reference(fused_ffn_reference)(x, gate_up, down)
    scale = float(jnp.abs(expected.astype(jnp.float32)).max())
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(
        np.asarray(out, np.float32) / scale, np.asarray(expected, np.float32) / scale, dtype
    )


def test_fused_ffn_gelu_tanh_gate_matches_reference():
    """Gemma's gate (HF's gelu_pytorch_tanh), written out in the kernel."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((37, 64)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((64, 2, 112)) / 8, jnp.float32)
    down = jnp.asarray(rng.standard_normal((112, 64)) / 112**0.5, jnp.float32)
    out = jit(fused_ffn, interpret=INTERPRET, activation="gelu_tanh")(x, gate_up, down)
    expected = reference(fused_ffn_reference, activation="gelu_tanh")(x, gate_up, down)
    silu = reference(fused_ffn_reference)(x, gate_up, down)
    assert_close(out, expected, jnp.float32)
    assert not np.allclose(expected, silu, rtol=1e-2)  # the activation made a difference


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_attention_at_gemma3_head_size(sliding_window):
    args = attention_batch([1, 9], [24, 30], group=4, head_dim=256, block_size=16, dtype=F32)
    kwargs = dict(sm_scale=256**-0.5, sliding_window=sliding_window)
    out = jit(ragged_paged_attention, interpret=INTERPRET, **kwargs)(*args)
    assert_close(out, reference(ragged_paged_attention_reference, **kwargs)(*args), F32)


def test_fused_ffn_refuses_shapes_it_cannot_tile():
    x = jnp.zeros((4, 60))
    with pytest.raises(ValueError, match="E=60"):
        fused_ffn(x, jnp.zeros((60, 2, 112)), jnp.zeros((112, 60)), interpret=INTERPRET)


@pytest.mark.parametrize(
    "num_tokens,hidden,dtype",
    sweep(cases=[(*s, d) for s in [(1, 576), (19, 64), (5, 4096)] for d in [F32, BF16]]),
)
def test_add_rms_norm_matches_reference(num_tokens, hidden, dtype):
    rng = np.random.default_rng(2)
    x, residual = (jnp.asarray(rng.standard_normal((num_tokens, hidden)), dtype) for _ in "ab")
    weight = jnp.asarray(rng.standard_normal(hidden), dtype)
    normed, summed = jit(add_rms_norm, eps=1e-5, interpret=INTERPRET)(x, residual, weight)
    # (no matmul; op by op, as the kernel rounds bf16 between its steps)
    expected_normed, expected_summed = add_rms_norm_reference(x, residual, weight, eps=1e-5)
    assert_close(summed, expected_summed, dtype)
    assert_close(normed, expected_normed, dtype)


# -- lowering for the GPU (CPU only: lowering, not running) ----------------------------------


def _triton_calls(text):
    return gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call())


def _attention_lowering(num_tokens, num_heads, num_kv_heads, head_dim, dtype, **kwargs):
    num_reqs, block_size, max_blocks = min(num_tokens, 64), 16, 64
    args = (
        jnp.zeros((num_tokens, num_heads, head_dim), dtype),
        jnp.zeros((4, 2, 128, block_size, num_kv_heads, head_dim), dtype),
        jnp.zeros((num_reqs, max_blocks), jnp.int32),
        jnp.zeros((num_reqs,), jnp.int32),
        jnp.zeros((num_reqs + 1,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.int32(1),
    )

    def attention(q, kv, tables, lens, starts, num_seqs, layer):
        return ragged_paged_attention(
            q, kv, tables, lens, starts, num_seqs, sm_scale=0.1, layer=layer, **kwargs
        )

    return gpu_lowering.lower_for_gpu(attention, *args)


@pytest.mark.parametrize(
    "shape",
    [
        dict(num_tokens=32, num_heads=9, num_kv_heads=3, head_dim=64),  # SmolLM2-135M, decode
        dict(num_tokens=512, num_heads=9, num_kv_heads=3, head_dim=64),  # SmolLM2, prefill
        dict(num_tokens=8, num_heads=32, num_kv_heads=8, head_dim=128),  # Llama-3-8B, splits
        dict(num_tokens=256, num_heads=32, num_kv_heads=8, head_dim=128, sliding_window=64),
        dict(num_tokens=32, num_heads=9, num_kv_heads=3, head_dim=64, dtype=jnp.float32),
        dict(num_tokens=64, num_heads=4, num_kv_heads=1, head_dim=256, sliding_window=512),
    ],
)
def test_attention_lowers_for_the_gpu(shape):
    text = _attention_lowering(**{"dtype": jnp.bfloat16, **shape})
    assert _triton_calls(text) == 1


def test_the_batch_invariant_forms_lower_for_the_gpu():
    x = jnp.zeros((32, 576), jnp.bfloat16)
    text = gpu_lowering.lower_for_gpu(
        lambda a, w: pallas_matmul(a, w), x, jnp.zeros((576, 1536), jnp.bfloat16)
    )
    assert _triton_calls(text) == 1
    gate_up = jnp.zeros((576, 2, 1536), jnp.bfloat16)
    down = jnp.zeros((1536, 576), jnp.bfloat16)
    text = gpu_lowering.lower_for_gpu(
        lambda a, g, d: fused_ffn(a, g, d, batch_invariant=True), x, gate_up, down
    )
    assert _triton_calls(text) == 2  # the gate/up kernel and the down projection's matmul
    assert (
        _triton_calls(_attention_lowering(8, 32, 8, 128, jnp.bfloat16, batch_invariant=True)) == 1
    )


def test_ffn_and_norm_lower_for_the_gpu():
    for hidden, intermediate in [(576, 1536), (4096, 14336)]:
        x = jnp.zeros((32, hidden), jnp.bfloat16)
        gate_up = jnp.zeros((hidden, 2, intermediate), jnp.bfloat16)
        down = jnp.zeros((intermediate, hidden), jnp.bfloat16)
        text = gpu_lowering.lower_for_gpu(fused_ffn, x, gate_up, down)
        assert _triton_calls(text) == 1
        weight = jnp.zeros((hidden,), jnp.bfloat16)
        text = gpu_lowering.lower_for_gpu(
            lambda x, r, w: add_rms_norm(x, r, w, eps=1e-5), x, x, weight
        )
        assert _triton_calls(text) == 1


def test_the_gpu_backend_is_triton():
    # The JAX here (0.10) and the GPU machine's (0.11) both ship Pallas' Triton backend.
    assert gpu_lowering.gpu_backend() == "triton"
    assert gpu_lowering.triton_custom_call()  # named by JAX's own lowering of a kernel


def test_lowering_for_the_gpu_uses_shapes_only():
    # Concrete CPU arrays and their shapes lower to the same module under the abstract GPU.
    x = jnp.ones((32, 576), jnp.float32)
    weight = jnp.ones((576,), jnp.float32)

    def norm(x, r, w):
        return add_rms_norm(x, r, w, eps=1e-5)

    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    concrete = gpu_lowering.lower_for_gpu(norm, x, x, weight)
    abstract = gpu_lowering.lower_for_gpu(norm, spec, spec, jax.ShapeDtypeStruct((576,), x.dtype))
    assert concrete == abstract and _triton_calls(concrete) == 1
