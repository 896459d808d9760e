"""Attention over a quantized KV cache (int8 per token and head, fp8 per head): every kernel
(the pure-JAX reference, the Pallas kernel interpreted, the C++ kernel) against
dequantize-then-attend, the reference over the float cache the quantized one stands for, within
float rounding, over the unquantized kernels' cases (block sizes, groups, head dims, dtypes,
mixed batches, sliding windows, kv splits, many decodes, one layer of a stacked cache)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import can_build
from pallas_kernels import gpu_lowering
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.kv_quant import (
    FP8_DTYPES,
    SCALE_LAYOUTS,
    dequantize_cache,
    quantize_cache,
)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tests.support.kernels import (
    ATTENTION_CASES,
    F32,
    INTERPRET,
    PAIRWISE_CASES,
    assert_close,
    attention_batch,
    jit,
    many_decodes,
    mixed_lengths,
    reference,
)
from tests.support.lanes import sweep

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
# How far the quantized result may be from the unquantized one on these N(0, 1) caches: a
# check that the cache is read as quantized at all (a kernel ignoring the scales is far off).
QUANTIZATION_ERROR = {"int8": 0.05, "fp8_e4m3": 0.3, "fp8_e5m2": 0.6}


def quantized(args, kind):
    """(args over the quantized cache, args over its dequantized float cache, its scales)."""
    q, kv, *rest = args
    values, scales = jax.jit(quantize_cache, static_argnums=1)(kv.astype(jnp.float32), kind)
    dequantize = jax.jit(dequantize_cache, static_argnums=2)
    restored = dequantize(values, scales, SCALE_LAYOUTS[kind]).astype(kv.dtype)
    return (q, values, *rest), (q, restored, *rest), scales


def check(kernel, args, kind, dtype, kernel_options=None, **static):
    quant_args, float_args, scales = quantized(args, kind)
    layout = SCALE_LAYOUTS[kind]
    out = jit(kernel, kv_scales=scales, kv_scale_layout=layout, **static, **(kernel_options or {}))(
        *quant_args
    )
    expected = reference(ragged_paged_attention_reference, **static)(*float_args)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, expected, dtype)
    unquantized = reference(ragged_paged_attention_reference, **static)(*args)
    error = np.abs(np.asarray(out, np.float32) - np.asarray(unquantized, np.float32)).max()
    assert 0 < error <= QUANTIZATION_ERROR[kind] + (0.05 if dtype != F32 else 0)
    return out


PALLAS = functools.partial(ragged_paged_attention, interpret=INTERPRET)


# Each of the Pallas kernel's pairwise cases, in one of the formats (cycled over them); the
# fast lane takes a few that hold every value.
@pytest.mark.parametrize(
    "block_size,group,head_dim,dtype,kind",
    sweep(cases=[(*case, FORMATS[i % 3]) for i, case in enumerate(PAIRWISE_CASES)]),
)
@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def test_mixed_batches(kernel, block_size, group, head_dim, dtype, kind):
    q_lens, context_lens = mixed_lengths(block_size)
    args = attention_batch(
        q_lens, context_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    fn = PALLAS if kernel == "pallas" else ragged_paged_attention_reference
    out = check(fn, args, kind, dtype, sm_scale=head_dim**-0.5)
    assert not np.asarray(out[sum(q_lens) :], np.float32).any()  # padding tokens: zeros


LONG = dict(q_lens=[1, 1, 3, 9], context_lens=[150, 17, 96, 200])


@pytest.mark.parametrize(
    "kind,num_kv_splits,sliding_window",
    sweep(cases=[(kind, *case) for kind in FORMATS for case in [(1, 20), (5, None)]]),
)
def test_pallas_kv_splits_and_sliding_window(kind, num_kv_splits, sliding_window):
    args = attention_batch(
        LONG["q_lens"], LONG["context_lens"], group=3, head_dim=64, block_size=16, dtype=F32
    )
    check(
        PALLAS,
        args,
        kind,
        F32,
        sm_scale=0.125,
        sliding_window=sliding_window,
        kernel_options={"num_kv_splits": num_kv_splits},
    )


@pytest.mark.parametrize("kernel,kind", sweep(["reference", "pallas", "cpu"], FORMATS))
def test_one_layer_of_a_stacked_cache(kernel, kind, request):
    if kernel == "cpu" and not can_build():
        pytest.skip("no C++ compiler, or a CPU without AVX2/FMA")
    fn = {"reference": ragged_paged_attention_reference, "pallas": PALLAS}.get(kernel)
    fn = fn or request.getfixturevalue("cpu_attention")
    q, kv, *rest = attention_batch([4, 1], [20, 33], group=4, head_dim=64, block_size=16, dtype=F32)
    stacked = jnp.stack([kv * 0.5, kv, kv * 3.0])  # [L, 2, NB, BS, K, D]
    values, scales = quantize_cache(stacked, kind)
    layout = SCALE_LAYOUTS[kind]
    out = jax.jit(
        lambda layer: fn(
            q, values, *rest, sm_scale=0.1, layer=layer, kv_scales=scales, kv_scale_layout=layout
        )
    )(jnp.int32(2))
    restored = dequantize_cache(values, scales, layout)[2]
    expected = reference(ragged_paged_attention_reference, sm_scale=0.1)(q, restored, *rest)
    assert_close(out, expected, F32)


needs_cpp = pytest.mark.skipif(not can_build(), reason="no C++ compiler, or no AVX2/FMA")


@needs_cpp
@pytest.mark.parametrize(
    "block_size,group,head_dim,kind",
    sweep(cases=[(*case, FORMATS[i % 3]) for i, case in enumerate(ATTENTION_CASES)]),
)
def test_cpu_mixed_batches(cpu_attention, block_size, group, head_dim, kind):
    q_lens, context_lens = mixed_lengths(block_size)
    args = attention_batch(
        q_lens, context_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=F32
    )
    out = check(cpu_attention, args, kind, F32, sm_scale=head_dim**-0.5)
    assert not np.asarray(out[sum(q_lens) :]).any()


@needs_cpp
@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_cpu_long_contexts_and_sliding_window(cpu_attention, kind, sliding_window):
    args = attention_batch(
        LONG["q_lens"], LONG["context_lens"], group=3, head_dim=64, block_size=16, dtype=F32
    )
    check(cpu_attention, args, kind, F32, sm_scale=0.125, sliding_window=sliding_window)


@needs_cpp
@pytest.mark.parametrize(
    "kind,group,num_kv_heads",  # SmolLM2's heads (3 a kv head), and kv heads split in pairs
    sweep(cases=[(kind, *heads) for kind in FORMATS for heads in [(3, 3), (8, 16)]]),
)
def test_cpu_many_decodes(cpu_attention, kind, group, num_kv_heads):
    """Decodes that take all their kv heads in one item, several heads' rows in pairs."""
    check(cpu_attention, many_decodes(group, num_kv_heads), kind, F32, sm_scale=0.125)


@needs_cpp
def test_cpu_kernel_refuses_mismatched_scales(cpu_attention):
    q, kv, *rest = attention_batch([2], [20], group=2, head_dim=16, block_size=8, dtype=F32)
    values, scales = quantize_cache(kv, "int8")
    with pytest.raises(TypeError, match="kv_scales"):
        cpu_attention(q, values, *rest, sm_scale=0.25)
    with pytest.raises(ValueError, match="kv_scale_layout"):  # scales without their layout
        cpu_attention(q, values, *rest, sm_scale=0.25, kv_scales=scales)
    with pytest.raises(ValueError, match="not per-head scales"):  # laid out otherwise
        cpu_attention(q, values, *rest, sm_scale=0.25, kv_scales=scales, kv_scale_layout="head")
    per_head = jnp.ones((2, values.shape[-2]), jnp.float32)  # f32[2, K]: fp8's layout
    with pytest.raises(TypeError, match="per-token scales"):  # int8 values read per head
        cpu_attention(q, values, *rest, sm_scale=0.25, kv_scales=per_head, kv_scale_layout="head")
    with pytest.raises(Exception, match="kv_scales must be"):
        cpu_attention(
            q, values, *rest, sm_scale=0.25, kv_scales=scales[..., :1], kv_scale_layout="token"
        )


@pytest.mark.parametrize("kind", FORMATS)
def test_pallas_over_a_quantized_cache_lowers_for_the_gpu(kind):
    """Lowered for CUDA under an abstract GPU (no GPU needed): one Triton call, decode-sized."""
    num_tokens, heads, kv_heads, head_dim, blocks, block_size = 32, 9, 3, 64, 128, 16
    cache_shape = (4, 2, blocks, block_size, kv_heads, head_dim)
    scales_shape = cache_shape[:-1] if kind == "int8" else (4, 2, kv_heads)
    args = (
        jnp.zeros((num_tokens, heads, head_dim), jnp.bfloat16),
        jnp.zeros(cache_shape, jnp.int8 if kind == "int8" else FP8_DTYPES[kind]),
        jnp.zeros(scales_shape, jnp.float32),
        jnp.zeros((num_tokens, 64), jnp.int32),
        jnp.zeros((num_tokens,), jnp.int32),
        jnp.zeros((num_tokens + 1,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
        jnp.int32(1),
    )

    def attention(q, kv, scales, tables, lens, starts, num_seqs, layer):
        return ragged_paged_attention(
            q,
            kv,
            tables,
            lens,
            starts,
            num_seqs,
            sm_scale=0.1,
            layer=layer,
            kv_scales=scales,
            kv_scale_layout=SCALE_LAYOUTS[kind],
        )

    text = gpu_lowering.lower_for_gpu(attention, *args)
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
