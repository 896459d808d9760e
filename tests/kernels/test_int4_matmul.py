"""int4 weights in groups: the packed format against a numpy packer written from its
definition, the quantizer's grid, the GGUF Q4_0/Q4_1 blocks against gguf.quants, and each
kernel (C++, Pallas in interpret mode, the pure-JAX reference) against dequantize-then-matmul
in float64, at every row count 1-64."""

from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.matmul.kernel import grouped_int4_matmul, has_avx512
from cpu_kernels.matmul.kernel import int4_matmul as cpu_int4_matmul
from jaxinfer.model_loader.gguf_blocks import int4_from_gguf
from pallas_kernels import gpu_lowering
from pallas_kernels.int4_matmul.kernel import int4_matmul as pallas_int4_matmul
from pallas_kernels.int4_matmul.reference import (
    dequantize,
    int4_matmul_reference,
    pack,
    quantize,
    unpack,
)
from tests.support.gguf_q4_k import quantize_q4_k

pytestmark = pytest.mark.slow


def packed_by_definition(q: np.ndarray) -> np.ndarray:
    """u8[N, K] values -> u8[N, K / 2]: in each run of 32 values, byte j holds value j in its
    low nibble and value j + 16 in its high nibble (the format's docstring, one byte at a time)."""
    n, k = q.shape
    out = np.zeros((n, k // 2), np.uint8)
    for row in range(n):
        for run in range(k // 32):
            for j in range(16):
                low, high = q[row, 32 * run + j], q[row, 32 * run + 16 + j]
                out[row, 16 * run + j] = low | (high << 4)
    return out


def test_pack_and_unpack_follow_the_definition():
    q = np.random.default_rng(0).integers(0, 16, (3, 96), dtype=np.uint8)
    np.testing.assert_array_equal(pack(q), packed_by_definition(q))
    np.testing.assert_array_equal(unpack(pack(q)), q)
    np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(pack(q)))), q)


@pytest.mark.parametrize("size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantize_is_the_nearest_point_of_each_group_grid(size, symmetric):
    rng = np.random.default_rng(size)
    w = rng.standard_normal((6, 256)).astype(np.float32)
    w[0, :size] = 0.0  # an all-zero group
    w[1, :size] = np.abs(w[1, :size])  # a group of one sign
    qs, scale, bias = quantize(w, size, symmetric)
    assert qs.shape == (6, 128) and scale.shape == bias.shape == (6, 256 // size)
    assert scale.dtype == bias.dtype == np.float16
    restored = dequantize(qs, scale, bias)
    step = np.repeat(scale.astype(np.float32), size, axis=-1)
    # each value within half a step of its group's grid (1e-3 of a step: float16 rounding of
    # the stored range)
    assert np.all(np.abs(restored - w) <= step * (0.5 + 1e-3) + 1e-6)
    if symmetric:
        np.testing.assert_array_equal(bias, (-8 * scale.astype(np.float32)).astype(np.float16))
    else:
        groups = w.reshape(6, -1, size)
        np.testing.assert_array_equal(bias, groups.min(-1).astype(np.float16))


def test_quantize_refuses_groups_that_do_not_tile_the_input():
    with pytest.raises(ValueError, match="multiple"):
        quantize(np.zeros((2, 96), np.float32), 64, symmetric=False)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_q4_blocks_load_as_int4_groups_of_32(fmt):
    """The file's blocks as Int4 arrays dequantize bit for bit as gguf.quants does (Q4_K's
    scale d sc and bias -dmin m in float32, Q4_0 / Q4_1's in float16)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 512)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[fmt]
    raw = quantize_q4_k(w) if fmt == "Q4_K" else gguf.quants.quantize(w, kind)
    qs, scale, bias = int4_from_gguf(fmt, raw)  # raw: u8[5, bytes per row]
    dtype = np.float32 if fmt == "Q4_K" else np.float16
    assert scale.dtype == bias.dtype == dtype and qs.shape == (5, 256)
    assert scale.shape == bias.shape == (5, 16)
    expected = gguf.quants.dequantize(raw, kind)
    np.testing.assert_array_equal(dequantize(qs, scale, bias), expected)


def random_int4(rng, n: int, k: int, size: int, scale_dtype, bias_dtype, layers: int = 0):
    """(qs, scale, bias) of a random weight [L?, n, k], scale and bias in their dtypes."""
    lead = (layers,) if layers else ()
    w = rng.standard_normal((*lead, n, k)).astype(np.float32)
    qs, scale, bias = quantize(w, size, symmetric=False)
    return qs, scale.astype(scale_dtype), bias.astype(bias_dtype)


def expected(x, qs, scale, bias) -> np.ndarray:
    """x @ W^T in float64, W dequantized."""
    return np.asarray(x, np.float64) @ dequantize(qs, scale, bias).astype(np.float64).T


def close(got, want, tolerance: float) -> None:
    error = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    assert error < tolerance, error


CPU_CASES = [  # N (outputs), K, group size, scale dtype, bias dtype
    (40, 576, 32, np.float16, np.float16),  # N not a multiple of the 16-column claims
    (33, 1536, 64, np.float32, np.float32),
    (17, 256, 128, np.float16, np.float32),  # AWQ/GPTQ: float16 scales, exact float32 biases
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"N{c[0]}-K{c[1]}-G{c[2]}")
def test_cpu_kernel_every_row_count(cpu_matmul, case):
    n, k, size, scale_dtype, bias_dtype = case
    rng = np.random.default_rng(n)
    qs, scale, bias = random_int4(rng, n, k, size, scale_dtype, bias_dtype)
    args = [jnp.asarray(a) for a in (qs, scale, bias)]
    x = rng.standard_normal((64, k)).astype(np.float32)
    few = (1, 3, 4, 9, 64)

    @jax.jit  # every row count's call in one program (one compile, not 74)
    def products(x, *args):
        return (
            [cpu_int4_matmul(x[:rows], *args) for rows in range(1, 65)],
            [cpu_int4_matmul(x[:rows], *args, fixed_order=True) for rows in few],
            [cpu_int4_matmul(x[:rows], *args, int8_activations=True) for rows in few],
        )

    default, fixed, int8 = products(jnp.asarray(x), *args)
    for rows in range(1, 65):
        want = expected(x[:rows], qs, scale, bias)
        close(default[rows - 1], want, 2e-6)
        if rows in few:
            close(fixed[few.index(rows)], want, 2e-6)
            # llama.cpp's approach: x rounded to int8 per 32 values (up to 4 rows), so the
            # error is that rounding's (about 1/254 of each run's largest value)
            close(int8[few.index(rows)], want, 2e-2 if rows <= 4 else 2e-6)


# The streamed rows' two paths: AVX2 everywhere, AVX-512 (table lookups) where the CPU has it.
STREAM_PATHS = [
    pytest.param(False, id="avx2"),
    pytest.param(
        True, id="avx512", marks=pytest.mark.skipif(not has_avx512(), reason="no AVX-512F")
    ),
]
STREAM_CASES = [  # N, K, group size: the runs of 32 in pairs, an odd one left, groups of 3 runs
    (40, 576, 32),
    (21, 608, 32),
    (19, 288, 96),
    (33, 1536, 64),
    (17, 256, 128),
]


@pytest.mark.parametrize("avx512", STREAM_PATHS)
@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: f"N{c[0]}-K{c[1]}-G{c[2]}")
def test_cpu_kernel_streamed_rows_on_each_path(cpu_matmul, case, avx512):
    n, k, size = case
    rng = np.random.default_rng(k)
    qs, scale, bias = random_int4(rng, n, k, size, np.float16, np.float32)
    args = [jnp.asarray(a) for a in (qs, scale, bias)]
    x = rng.standard_normal((4, k)).astype(np.float32)
    for rows in range(1, 5):
        got = cpu_int4_matmul(jnp.asarray(x[:rows]), *args, avx512=avx512)
        close(got, expected(x[:rows], qs, scale, bias), 2e-6)
    # grouped (the experts' product): two groups of 3 and 1 rows, each streamed
    stacked = [jnp.asarray(np.stack([a, a[::-1]])) for a in (qs, scale, bias)]
    sizes = jnp.asarray([3, 1], jnp.int32)
    got = np.asarray(grouped_int4_matmul(jnp.asarray(x), *stacked, sizes, avx512=avx512))
    close(got[:3], expected(x[:3], qs, scale, bias), 2e-6)
    close(got[3:], expected(x[3:], qs[::-1], scale[::-1], bias[::-1]), 2e-6)


@pytest.mark.skipif(has_avx512(), reason="this CPU has AVX-512F")
def test_cpu_kernel_refuses_avx512_without_it(cpu_matmul):
    qs, scale, bias = random_int4(np.random.default_rng(0), 16, 64, 32, np.float16, np.float16)
    x = jnp.zeros((1, 64), jnp.float32)
    with pytest.raises(Exception, match="AVX-512F"):
        jax.block_until_ready(cpu_int4_matmul(x, *map(jnp.asarray, (qs, scale, bias)), avx512=True))


def test_cpu_kernel_fixed_order_is_independent_of_the_row_count(cpu_matmul):
    rng = np.random.default_rng(7)
    qs, scale, bias = (
        jnp.asarray(a) for a in random_int4(rng, 48, 256, 32, np.float16, np.float16)
    )
    x = jnp.asarray(rng.standard_normal((37, 256)).astype(np.float32))
    full = np.asarray(cpu_int4_matmul(x, qs, scale, bias, fixed_order=True))
    for rows in (1, 2, 5, 8, 36):
        part = np.asarray(cpu_int4_matmul(x[:rows], qs, scale, bias, fixed_order=True))
        np.testing.assert_array_equal(part, full[:rows])


def test_cpu_kernel_reads_a_stacked_layer_in_place(cpu_matmul):
    rng = np.random.default_rng(3)
    qs, scale, bias = random_int4(rng, 24, 128, 32, np.float16, np.float16, layers=3)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    stacked = [jnp.asarray(a) for a in (qs, scale, bias)]
    run = jax.jit(lambda x, i: cpu_int4_matmul(x, *stacked, layer=i))
    for layer in range(3):
        close(run(jnp.asarray(x), layer), expected(x, qs[layer], scale[layer], bias[layer]), 2e-6)


def test_cpu_kernel_refuses_bad_shapes(cpu_matmul):
    x = jnp.zeros((2, 64), jnp.float32)
    qs = jnp.zeros((8, 32), jnp.uint8)
    scale = jnp.zeros((8, 2), jnp.float16)
    with pytest.raises(ValueError, match="int4_matmul"):
        cpu_int4_matmul(x, qs, scale, jnp.zeros((8, 1), jnp.float16))  # bias groups differ
    with pytest.raises(ValueError, match="int4_matmul"):
        cpu_int4_matmul(x, qs, jnp.zeros((8, 3), jnp.float16), jnp.zeros((8, 3), jnp.float16))
    with pytest.raises(ValueError, match="int4_matmul"):
        cpu_int4_matmul(x.astype(jnp.bfloat16), qs, scale, scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernel_in_interpret_mode(dtype):
    rng = np.random.default_rng(5)
    kernel = jax.jit(functools.partial(pallas_int4_matmul, interpret=True))  # one compile each
    for n, k, size in [(64, 256, 32), (48, 384, 128), (32, 128, 64)]:
        qs, scale, bias = random_int4(rng, n, k, size, np.float16, np.float32)
        args = [jnp.asarray(a) for a in (qs, scale, bias)]
        for rows in (1, 5, 17):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            got = kernel(jnp.asarray(x, dtype), *args)
            assert got.dtype == dtype and got.shape == (rows, n)
            want = expected(np.asarray(jnp.asarray(x, dtype), np.float32), qs, scale, bias)
            close(got, want, 2e-6 if dtype == jnp.float32 else 2e-2)


def test_pallas_kernel_keeps_leading_output_axes():
    rng = np.random.default_rng(6)
    qs, scale, bias = random_int4(rng, 32, 64, 32, np.float16, np.float16)
    x = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    split = [jnp.asarray(a).reshape(2, 16, -1) for a in (qs, scale, bias)]
    got = pallas_int4_matmul(x, *split, interpret=True)
    np.testing.assert_allclose(
        got.reshape(3, 32), expected(x, qs, scale, bias), rtol=1e-5, atol=1e-5
    )


def test_reference_matches_numpy():
    rng = np.random.default_rng(8)
    qs, scale, bias = random_int4(rng, 16, 128, 64, np.float16, np.float16)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    got = int4_matmul_reference(jnp.asarray(x), *(jnp.asarray(a) for a in (qs, scale, bias)))
    close(got, expected(x, qs, scale, bias), 2e-6)


def test_pallas_kernel_lowers_for_the_gpu():
    x = jnp.zeros((8, 256), jnp.bfloat16)
    qs = jnp.zeros((64, 128), jnp.uint8)
    scale = bias = jnp.zeros((64, 8), jnp.float16)
    text = gpu_lowering.lower_for_gpu(lambda *a: pallas_int4_matmul(*a), x, qs, scale, bias)
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
