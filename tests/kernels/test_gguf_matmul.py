"""The C++ kernel for weights in llama.cpp's block formats (cpu_kernels.gguf_matmul): against
float64 numpy on the weights the gguf package dequantizes, and bit for bit against the float32
kernel (cpu_kernels.matmul) on those weights for up to 3 rows."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import can_build
from cpu_kernels.gguf_matmul.reference import dequantize, gguf_matmul_reference

pytestmark = pytest.mark.skipif(
    not can_build(), reason="no C++ compiler, or a CPU without AVX2/FMA"
)


def random_blocks(fmt: str, n: int, k: int, seed: int = 0, lead: tuple[int, ...] = ()):
    """(qs, scales) of random [*lead, n, k] weights, with scales that are float16 values (as
    in a GGUF file)."""
    rng = np.random.default_rng(seed)
    blocks = (*lead, n, k // 32)
    if fmt == "Q4_1":
        qs = rng.integers(0, 256, size=(*lead, n, k // 2), dtype=np.uint8)
        d = rng.uniform(1e-4, 2e-2, size=blocks)
        m = -rng.uniform(0, 0.15, size=blocks)
        scales = np.stack([d, m], axis=-1)
    else:
        qs = rng.integers(-127, 128, size=(*lead, n, k), dtype=np.int8)
        scales = rng.uniform(1e-4, 2e-2, size=blocks)
    return qs, scales.astype(np.float16).astype(np.float32)


def gguf_packed(fmt: str, qs: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The same [n, k] weight as the raw blocks of a GGUF tensor (d, m float16, then the
    quantized values), for the gguf package to dequantize."""
    n = qs.shape[0]
    halves = (
        scales.astype(np.float16)
        .view(np.uint8)
        .reshape(n, qs.shape[1] // (16 if fmt == "Q4_1" else 32), -1)
    )
    values = qs.view(np.uint8).reshape(n, halves.shape[1], -1)
    return np.concatenate([halves, values], axis=-1).reshape(n, -1)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_dequantize_matches_the_gguf_package(fmt):
    qs, scales = random_blocks(fmt, 24, 96, seed=3)
    kind = getattr(gguf.GGMLQuantizationType, fmt)
    theirs = gguf.quants.dequantize(gguf_packed(fmt, qs, scales), kind)
    assert np.array_equal(dequantize(fmt, qs, scales).view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize(("n", "k"), [(48, 576), (5, 32), (70, 96)])
def test_kernel_matches_numpy(cpu_gguf_matmul, fmt, rows, n, k):
    qs, scales = random_blocks(fmt, n, k, seed=rows * k + n)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    ours = np.asarray(jax.jit(cpu_gguf_matmul, static_argnums=0)(fmt, x, qs, scales))
    exact = x.astype(np.float64) @ dequantize(fmt, qs, scales).astype(np.float64).T
    assert ours.shape == (rows, n) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, exact, rtol=2e-5, atol=2e-5 * np.abs(exact).max())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_kernel_is_bit_identical_to_the_float32_kernel(cpu_gguf_matmul, cpu_matmul, fmt, rows):
    """Up to 3 rows the block kernel sums exactly as the float32 kernel does on the dequantized
    weights; the products must match to the bit (the default model's gate_up shape)."""
    qs, scales = random_blocks(fmt, 3072, 576, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
    ours = np.asarray(cpu_gguf_matmul(fmt, jnp.asarray(x), jnp.asarray(qs), jnp.asarray(scales)))
    w = jnp.asarray(dequantize(fmt, qs, scales))
    theirs = np.asarray(cpu_matmul(jnp.asarray(x), w))
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_kernel_reads_one_layer_of_stacked_blocks(cpu_gguf_matmul, fmt):
    qs, scales = random_blocks(fmt, 40, 64, seed=5, lead=(3,))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32))

    @jax.jit
    def per_layer(x, qs, scales):
        def body(_, layer):
            return None, cpu_gguf_matmul(fmt, x, qs, scales, layer=layer)

        return jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))[1]

    ours = np.asarray(per_layer(x, qs, scales))
    for layer in range(3):
        want = np.asarray(gguf_matmul_reference(fmt, x, qs[layer], scales[layer]))
        np.testing.assert_allclose(ours[layer], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_kernel_rejects_wrong_dtypes_and_shapes(cpu_gguf_matmul):
    qs, scales = random_blocks("Q4_1", 8, 64)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="block format"):
        cpu_gguf_matmul("Q5_K", x, qs, scales)
    with pytest.raises(ValueError, match=r"K a multiple of 32"):
        cpu_gguf_matmul("Q4_1", x[:, :48], qs, scales)
    with pytest.raises(ValueError, match="qs uint8"):
        cpu_gguf_matmul("Q4_1", x, qs.view(np.int8), scales)
    with pytest.raises(ValueError, match="scales"):
        cpu_gguf_matmul("Q4_1", x, qs, scales[..., 0])
