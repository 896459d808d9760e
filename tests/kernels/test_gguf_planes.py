"""llama.cpp's block formats on the GPU side (pallas_kernels.gguf_matmul): every format split
into planes gives the gguf package's own values; the Pallas kernels, run through Pallas'
interpreter, against the pure-JAX reference; the reference against float64 numpy; and both
kernels lowered for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.gguf_matmul.reference import FORMATS, random_rows
from cpu_kernels.gguf_matmul.reference import dequantize as gguf_dequantize
from pallas_kernels import gpu_lowering
from pallas_kernels.gguf_matmul.kernel import byte_matmul, gguf_matmul
from pallas_kernels.gguf_matmul.reference import (
    FOUR_BIT,
    dequantize,
    gguf_matmul_reference,
    to_planes,
)
from tests.support.lanes import sweep

K = 512  # two k-quant superblocks


def planes(fmt: str, n: int, k: int = K, seed: int = 0):
    raw = random_rows(fmt, n, k, np.random.default_rng(seed))
    return raw, to_planes(fmt, raw)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_planes_give_the_gguf_packages_values(fmt):
    raw, (codes, scale, bias) = planes(fmt, 24)
    got, want = dequantize(codes, scale, bias), gguf_dequantize(fmt, raw)
    assert got.dtype == np.float32 and got.shape == want.shape == (24, K)
    np.testing.assert_array_equal(got, want)  # exact values (-0.0 == 0.0)
    assert codes.dtype == (np.uint8 if fmt in FOUR_BIT else np.int8)
    group = 16 if fmt == "Q6_K" else 32
    assert scale.shape == bias.shape == (24, K // group)
    assert scale.dtype == (np.float32 if fmt.endswith("_K") else np.float16)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_matches_numpy(fmt):
    raw, arrays = planes(fmt, 32, seed=2)
    x = np.random.default_rng(3).standard_normal((5, K)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        got = gguf_matmul_reference(jnp.asarray(x), *map(jnp.asarray, arrays))
    want = x.astype(np.float64) @ gguf_dequantize(fmt, raw).astype(np.float64).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt,dtype", sweep(list(FORMATS), [jnp.float32, jnp.bfloat16]))
def test_pallas_kernel_matches_reference(fmt, dtype):
    _, arrays = planes(fmt, 64, seed=4)
    arrays = tuple(map(jnp.asarray, arrays))
    for rows in (1, 37):  # one row; rows padded to two programs
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, K)), dtype)
        got = jax.jit(lambda *a: gguf_matmul(*a, interpret=True))(x, *arrays)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(gguf_matmul_reference)(x, *arrays)
        assert got.shape == (rows, 64) and got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


def test_byte_kernel_refuses_shapes_it_cannot_tile():
    codes = jnp.zeros((24, 64), jnp.int8)  # N = 24: no power-of-two tile of 16 or more
    scale = bias = jnp.zeros((24, 2), jnp.float16)
    with pytest.raises(ValueError, match="tiles N=24"):
        byte_matmul(jnp.zeros((1, 64)), codes, scale, bias, interpret=True)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
def test_pallas_kernel_lowers_for_the_gpu(fmt):
    _, arrays = planes(fmt, 64)
    x = jnp.zeros((8, K), jnp.bfloat16)
    text = gpu_lowering.lower_for_gpu(lambda *a: gguf_matmul(*a), x, *map(jnp.asarray, arrays))
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
