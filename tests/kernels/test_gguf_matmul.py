"""The C++ kernel for weights in llama.cpp's block formats as a GGUF file stores them
(cpu_kernels.gguf_matmul): every format's exact mode bit for bit against the gguf package's own
dequantizer, both modes against float64 numpy (the int8-activation mode against x rounded as
that mode rounds it), for 1 to many rows, weights of several formats and stacked layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import can_build
from cpu_kernels.gguf_matmul import reference
from cpu_kernels.gguf_matmul.kernel import gguf_rows, has_avx512_vnni
from cpu_kernels.gguf_matmul.reference import (
    FORMATS,
    dequantize_layer,
    gguf_matmul_reference,
    pack_layers,
    random_rows,
)

pytestmark = pytest.mark.skipif(
    not can_build(), reason="no C++ compiler, or a CPU without AVX2/FMA"
)

# The activation modes on each instruction set: AVX2 everywhere, and the AVX-512 VNNI paths
# where this CPU has them.
VNNI = pytest.mark.skipif(not has_avx512_vnni(), reason="a CPU without AVX-512 VNNI")
MODES = {
    "exact": {"int8_activations": False, "avx512_vnni": False},
    "exact-avx512vnni": {"int8_activations": False, "avx512_vnni": True},
    "int8-avx2": {"int8_activations": True, "avx512_vnni": False},
    "int8-avx512vnni": {"int8_activations": True, "avx512_vnni": True},
}


def mode_params(kind: str = "") -> list:
    """The modes whose name holds `kind`, those on AVX-512 VNNI skipped on a CPU without."""
    return [pytest.param(m, marks=VNNI) if "vnni" in m else m for m in MODES if kind in m]


MODE_PARAMS, INT8_PARAMS, EXACT_PARAMS = mode_params(), mode_params("int8"), mode_params("exact")


def weight(fmt: str, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return pack_layers([[(fmt, random_rows(fmt, n, k, rng))]])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("mode", EXACT_PARAMS)
def test_exact_mode_gives_the_gguf_packages_values_bit_for_bit(cpu_gguf_matmul, fmt, mode):
    """x = the identity picks every weight out of the product unrounded: the kernel's own
    dequantization, through the matmul paths (512 rows at once: the float panels; 3, 2 and 1
    at a time: the blocks streamed) and the rows path."""
    k = 512
    data, table = weight(fmt, 40, k, seed=1)
    theirs = dequantize_layer(data[0], table[0], k)  # gguf.quants
    eye = jnp.eye(k, dtype=jnp.float32)
    run = jax.jit(lambda x: cpu_gguf_matmul(x, data, table, 0, n=40, **MODES[mode]))
    assert np.array_equal(np.asarray(run(eye)).T, theirs)
    steps = [eye[j : j + 3] for j in range(0, k - 5, 3)] + [eye[-5:-3], eye[-3:-2], eye[-2:]]
    streamed = np.concatenate([np.asarray(run(x)) for x in steps])
    assert np.array_equal(streamed.T, theirs)
    rows = np.asarray(gguf_rows(jnp.arange(40), jnp.asarray(data), jnp.asarray(table), 0, k=k))
    assert np.array_equal(rows.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("mode", MODE_PARAMS)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 12, 21, 277])
def test_kernel_matches_numpy(cpu_gguf_matmul, fmt, mode, rows):
    """Few rows stream the weight row with every accumulator in registers (int8: 1-4 rows,
    1-8 on AVX-512 VNNI; exact: 1-3); more take the many-row paths (int8: chunks of 16 rows,
    on AVX-512 VNNI tiles of 16 or 8 padded with zero rows; exact: float panels)."""
    k = 768 if FORMATS[fmt][1] == 256 else 224
    data, table = weight(fmt, 37, k, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    ours = cpu_gguf_matmul(jnp.asarray(x), data, table, 0, n=37, **MODES[mode])
    theirs = gguf_matmul_reference(x, data, table, int8_activations=MODES[mode]["int8_activations"])
    assert ours.shape == (rows, 37) and ours.dtype == jnp.float32
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("mode", INT8_PARAMS)
def test_int8_activations_round_x_as_llama_cpp_does(cpu_gguf_matmul, mode):
    """The int8 mode differs from the exact one by x's rounding only: against exact x it is
    off by about that rounding (relative 1e-2), against rounded x by float error."""
    k = 512
    data, table = weight("Q4_K", 64, k, seed=5)
    x = np.random.default_rng(5).standard_normal((2, k)).astype(np.float32)
    ours = np.asarray(cpu_gguf_matmul(jnp.asarray(x), data, table, 0, n=64, **MODES[mode]))
    exact = gguf_matmul_reference(x, data, table)
    rounded = gguf_matmul_reference(x, data, table, int8_activations=True)
    scale = np.abs(exact).max()
    assert 1e-4 < np.abs(ours - exact).max() / scale < 3e-2
    assert np.abs(ours - rounded).max() / scale < 1e-5


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_segments_of_several_formats_and_stacked_layers(cpu_gguf_matmul, mode):
    """A fused weight whose parts differ in format (Q4_K_M's Q4_K and Q6_K rows; Q5_0 and Q8_0
    for rows of 896 values), layers that differ, each read in place by its index under jit."""
    rng = np.random.default_rng(7)
    k = 512
    layers = [
        [("Q4_K", random_rows("Q4_K", 24, k, rng)), ("Q6_K", random_rows("Q6_K", 8, k, rng))],
        [("Q6_K", random_rows("Q6_K", 32, k, rng))],
        [("Q5_0", random_rows("Q5_0", 16, k, rng)), ("Q8_0", random_rows("Q8_0", 16, k, rng))],
    ]
    data, table = pack_layers(layers)
    x = rng.standard_normal((5, k)).astype(np.float32)
    run = jax.jit(lambda x, d, t, i: cpu_gguf_matmul(x, d, t, i, n=32, **MODES[mode]))
    for layer in range(3):
        ours = np.asarray(run(jnp.asarray(x), data, table, jnp.int32(layer)))
        theirs = gguf_matmul_reference(x, data, table, layer, MODES[mode]["int8_activations"])
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())


def test_bad_tables_are_clear_errors(cpu_gguf_matmul):
    data, table = weight("Q4_0", 8, 64)
    x = jnp.ones((1, 64), jnp.float32)
    with pytest.raises(Exception, match="segments' rows do not sum to N"):
        cpu_gguf_matmul(x, data, table, 0, n=9).block_until_ready()
    bad = table.copy()
    bad[0, 0, 0] = 1  # F16: not a block format
    with pytest.raises(Exception, match="not a supported block format"):
        cpu_gguf_matmul(x, data, bad, 0, n=8).block_until_ready()
    bad = table.copy()
    bad[0, 0, 2] = 16  # past the layer's bytes
    with pytest.raises(Exception, match="outside the layer's bytes"):
        cpu_gguf_matmul(x, data, bad, 0, n=8).block_until_ready()
    with pytest.raises(ValueError, match="data u8"):
        cpu_gguf_matmul(x, data.astype(np.int8), table, 0, n=8)


@pytest.mark.skipif(has_avx512_vnni(), reason="this CPU has AVX-512 VNNI")
def test_avx512_vnni_on_a_cpu_without_it_is_a_clear_error(cpu_gguf_matmul):
    data, table = weight("Q4_K", 8, 256)
    x = jnp.ones((1, 256), jnp.float32)
    with pytest.raises(Exception, match="without AVX-512"):
        cpu_gguf_matmul(x, data, table, 0, n=8, int8_activations=True, avx512_vnni=True)


def test_random_rows_cover_each_format():
    """The test blocks: the float16 scales finite, the values every bit pattern."""
    rng = np.random.default_rng(0)
    for fmt in FORMATS:
        raw = random_rows(fmt, 4, 256, rng)
        assert raw.shape == (4, reference.row_bytes(fmt, 256))
        assert np.isfinite(reference.dequantize(fmt, raw)).all()
