"""The C++ int8 kernel (cpu_kernels.int8_matmul) against numpy and its pure-JAX reference,
its build cache, and the choice between it and XLA (jaxinfer.layers.int8_kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import build, compiler
from cpu_kernels.int8_matmul.kernel import SOURCE, int8_matmul, load_int8_matmul
from cpu_kernels.int8_matmul.reference import int8_matmul_reference
from jaxinfer.layers.int8_kernel import select_int8_matmul

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return load_int8_matmul(tmp_path_factory.mktemp("cpu_kernels"))


def operands(rows: int, out: tuple[int, ...], k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.integers(-127, 128, size=(*out, k)).astype(np.int8)
    scale = (rng.random(out) * 0.02 + 0.001).astype(np.float32)
    return x, w, scale


def expected(x, w, scale):  # float64 numpy: (x @ w^T) * scale
    out = w.shape[:-1]
    y = x.astype(np.float64) @ w.reshape(-1, w.shape[-1]).astype(np.float64).T
    return (y * scale.reshape(-1)).reshape(x.shape[0], *out)


# Rows cover the one-to-three-row path and the converted-tile path with every remainder of its
# 3-row blocks; K covers whole 32-value steps, an 8-value tail and a scalar tail; N covers
# partial 16-row tiles and partial 4-row blocks.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 32, 37])
@pytest.mark.parametrize(("out", "k"), [((48,), 576), ((2, 21), 72), ((5, 3, 7), 100), ((1,), 9)])
def test_kernel_matches_numpy(kernel, rows, out, k):
    x, w, scale = operands(rows, out, k, seed=rows * k)
    ours = np.asarray(jax.jit(kernel)(x, w, scale))
    want = expected(x, w, scale)
    assert ours.shape == want.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_kernel_matches_its_reference_on_a_layer_shape(kernel):
    x, w, scale = operands(8, (2, 1536), 576)  # the default model's gate_up, 8 rows
    ours = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale)))
    reference = np.asarray(
        int8_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale))
    )
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_kernel_rejects_wrong_dtypes_and_shapes(kernel):
    x, w, scale = operands(2, (8,), 16)
    with pytest.raises(TypeError, match="float32 x, int8 w"):
        kernel(x.astype(np.float16), w, scale)
    with pytest.raises(ValueError, match=r"x \[T, K\]"):
        kernel(x[:, :8], w, scale)


def test_build_is_cached_by_source(tmp_path):
    first = build(SOURCE, tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build(SOURCE, tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left


SELECT = dict(
    quantization="int8",
    platform="cpu",
    tensor_parallel_size=1,
    weight_layout="out_in",
    dtype=jnp.float32,
)


def test_auto_picks_the_kernel_where_it_runs(tmp_path):
    assert select_int8_matmul("auto", build_dir=tmp_path, **SELECT) is int8_matmul
    assert select_int8_matmul("xla", build_dir=tmp_path, **SELECT) is None
    for change in (
        {"quantization": None},
        {"platform": "gpu"},
        {"tensor_parallel_size": 2},
        {"weight_layout": "in_out"},
        {"dtype": jnp.bfloat16},
    ):
        assert select_int8_matmul("auto", build_dir=tmp_path, **{**SELECT, **change}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization": None}, "quantization='int8' weights only"),
        ({"tensor_parallel_size": 2}, "one device"),
        ({"weight_layout": "in_out"}, "'out_in' weight layout"),
        ({"dtype": jnp.bfloat16}, "float32 activations, not bfloat16"),
    ],
)
def test_cpu_where_it_cannot_run_is_a_clear_error(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        select_int8_matmul("cpu", build_dir=tmp_path, **{**SELECT, **change})


def test_unknown_impl_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="int8_matmul_impl must be one of"):
        select_int8_matmul("avx512", build_dir=tmp_path, **SELECT)
