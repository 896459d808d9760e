"""The C++ kernels against numpy and their pure-JAX references: matmul (cpu_kernels.matmul)
and paged attention (cpu_kernels.paged_attention); the build cache; and the choice between
them and XLA (jaxinfer.layers.native_kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build as build_module
from cpu_kernels.build import KernelBuildError, build, can_build
from cpu_kernels.matmul.kernel import load_matmul
from cpu_kernels.matmul.reference import matmul_reference
from cpu_kernels.paged_attention.reference import ragged_paged_attention_reference
from jaxinfer.layers.native_kernels import KernelMatmul
from jaxinfer.layers.quantization import quantize_int8
from tests.support.kernels import (
    ATTENTION_CASES,
    F32,
    assert_close,
    attention_batch,
    jit,
    many_decodes,
    mixed_lengths,
)
from tests.support.lanes import sweep

pytestmark = pytest.mark.skipif(
    not can_build(), reason="no C++ compiler, or a CPU without AVX2/FMA"
)


@pytest.fixture(scope="module")
def kernel(cpu_matmul):
    return cpu_matmul


def operands(rows: int, out: tuple[int, ...], k: int, int8: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    if not int8:
        return x, rng.standard_normal((*out, k)).astype(np.float32), None
    w = rng.integers(-127, 128, size=(*out, k)).astype(np.int8)
    scale = (rng.random(out) * 0.02 + 0.001).astype(np.float32)
    return x, w, scale


def expected(x, w, scale):  # float64 numpy: (x @ w^T) (* scale)
    out = w.shape[:-1]
    y = x.astype(np.float64) @ w.reshape(-1, w.shape[-1]).astype(np.float64).T
    if scale is not None:
        y = y * scale.reshape(-1)
    return y.reshape(x.shape[0], *out)


# Rows cover the one-to-three-row path (K: whole 32-value steps, an 8-value tail and a
# scalar tail) and the outer-product path: partial blocks of 8 rows (4-7), 16 (12) and 24
# (20), a whole 32-row block (32) and an 8-row block after it (37). N covers a whole
# 48-column tile, partial tiles and remainders of the 3-, 6- and 12-column blocks.
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 20, 32, 37])
@pytest.mark.parametrize(("out", "k"), [((48,), 576), ((2, 21), 72), ((5, 3, 7), 100), ((1,), 9)])
def test_kernel_matches_numpy(kernel, int8, rows, out, k):
    x, w, scale = operands(rows, out, k, int8, seed=rows * k)
    ours = np.asarray(jax.jit(kernel)(x, w, scale))
    exact = expected(x, w, scale)
    assert ours.shape == exact.shape and ours.dtype == np.float32
    want = exact
    if int8 and rows <= 3:  # these rows of x are rounded to int16 (one scale per row) first
        want = expected(rounded_to_int16(x, k), w, scale)
        np.testing.assert_allclose(ours, exact, atol=2e-4 * np.abs(exact).max())
    np.testing.assert_allclose(ours, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def rounded_to_int16(x, k):
    """x as the kernel multiplies it against int8 weights with up to 3 rows: rounded to int16
    with one scale per row (the values past the last whole 32 of K stay float)."""
    row_scale = np.abs(x).max(axis=1, keepdims=True).astype(np.float64) / 32767
    rounded = np.rint(x / row_scale.astype(np.float32)) * row_scale
    whole = k - k % 32
    return np.concatenate([rounded[:, :whole], x[:, whole:]], axis=1)


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "float32"])
def test_kernel_matches_its_reference_on_a_layer_shape(kernel, int8):
    x, w, scale = operands(8, (2, 1536), 576, int8)  # the default model's gate_up, 8 rows
    args = [jnp.asarray(a) for a in (x, w)] + [None if scale is None else jnp.asarray(scale)]
    ours, reference = np.asarray(kernel(*args)), np.asarray(matmul_reference(*args))
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_kernel_rejects_wrong_dtypes_and_shapes(kernel):
    x, w, scale = operands(2, (8,), 16, int8=True)
    with pytest.raises(TypeError, match="float32 x with float32 w"):
        kernel(x.astype(np.float16), w, scale)
    with pytest.raises(TypeError, match="int8 w and its scale"):
        kernel(x, w)  # int8 without a scale
    with pytest.raises(ValueError, match=r"x \[T, K\]"):
        kernel(x[:, :8], w, scale)


def test_build_is_cached_by_source(tmp_path):
    source = tmp_path / "tiny" / "kernel.cc"  # a small source: the caching is the subject
    source.parent.mkdir()
    source.write_text('extern "C" int jaxinfer_tiny() { return 1; }\n')
    out = tmp_path / "build"
    first = build(source, out)
    mtime = first.stat().st_mtime_ns
    assert build(source, out) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in out.iterdir()] == [first.name]  # no partial files left
    source.write_text('extern "C" int jaxinfer_tiny() { return 2; }\n')
    second = build(source, out)
    assert second != first and sorted(p.name for p in out.iterdir()) == sorted(
        [first.name, second.name]
    )


def test_build_name_follows_the_compilers_version(tmp_path, monkeypatch):
    source = tmp_path / "tiny" / "kernel.cc"
    source.parent.mkdir()
    source.write_text('extern "C" int jaxinfer_tiny() { return 1; }\n')
    first = build(source, tmp_path / "build")
    monkeypatch.setattr(build_module, "compiler_version", lambda cxx: "g++ (another) 99.1")
    assert build(source, tmp_path / "build") != first  # a new compiler builds anew


def test_a_cpu_without_avx2_builds_no_kernel(tmp_path, monkeypatch):
    """The kernels are compiled with -mavx2 -mfma: on a CPU without those, building one is a
    clear error (instead of dying on an illegal instruction); tests/unit/test_resolve.py checks
    that "auto" then goes without them."""
    monkeypatch.setattr(build_module, "cpu_features", lambda: frozenset({"sse2", "avx"}))
    source = tmp_path / "tiny" / "kernel.cc"
    source.parent.mkdir()
    source.write_text('extern "C" int jaxinfer_tiny() { return 1; }\n')
    with pytest.raises(KernelBuildError, match="lacks AVX2, FMA"):
        build(source, tmp_path / "build")
    assert not (tmp_path / "build").exists()


def test_long_float32_products_stay_on_xla(cpu_kernel_dir):
    """Float32 products of more than max_float_rows rows take XLA's ops (no custom call in the
    program), int8 ones the kernel at any length; both agree with the reference."""
    chosen = KernelMatmul(load_matmul(cpu_kernel_dir), max_float_rows=4)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    q, scale = quantize_int8(w, axis=-1)
    for rows, weights, uses_kernel in (
        (4, (w,), True),
        (5, (w,), False),
        (5, (q, scale), True),
    ):
        x = rng.standard_normal((rows, 40)).astype(np.float32)
        product = chosen.float32 if len(weights) == 1 else chosen.int8
        hlo = jax.jit(product).lower(x, *weights).as_text()
        assert ("custom_call" in hlo) == uses_kernel, (rows, len(weights))
        expected = matmul_reference(jnp.asarray(x), *map(jnp.asarray, weights))
        np.testing.assert_allclose(product(x, *weights), expected, rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def attention(cpu_attention):
    return cpu_attention


@pytest.mark.parametrize("block_size,group,head_dim", sweep(cases=ATTENTION_CASES))
def test_attention_matches_reference(attention, block_size, group, head_dim):
    q_lens, context_lens = mixed_lengths(block_size)
    args = attention_batch(
        q_lens, context_lens, group=group, head_dim=head_dim, block_size=block_size, dtype=F32
    )
    scale = head_dim**-0.5
    out = jit(attention, sm_scale=scale)(*args)
    expected = jit(ragged_paged_attention_reference, sm_scale=scale)(*args)
    assert out.shape == expected.shape and out.dtype == F32
    assert_close(out, expected, F32)
    assert not np.asarray(out[sum(q_lens) :]).any()  # padding tokens: zeros


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_attention_long_contexts_and_sliding_window(attention, sliding_window):
    args = attention_batch(
        [1, 1, 3, 9], [150, 17, 96, 200], group=3, head_dim=64, block_size=16, dtype=F32
    )
    kwargs = dict(sm_scale=0.125, sliding_window=sliding_window)
    out = jit(attention, **kwargs)(*args)
    assert_close(out, jit(ragged_paged_attention_reference, **kwargs)(*args), F32)


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "sliding_window"),
    [(3, 3, None), (3, 3, 40), (8, 16, None), (1, 2, None)],
    ids=["smollm2", "window", "heads-split", "mha"],
)
def test_attention_many_decodes(attention, group, num_kv_heads, sliding_window):
    """Enough decodes for the kernel to give each one all its kv heads in one item (in
    chunks of 64 query heads at most: 8 x 16 heads takes two), with the next block and the
    next item's first block fetched ahead, beside a prefill chunk that keeps per-head items."""
    args = many_decodes(group, num_kv_heads)
    kwargs = dict(sm_scale=0.125, sliding_window=sliding_window)
    out = jit(attention, **kwargs)(*args)
    assert_close(out, jit(ragged_paged_attention_reference, **kwargs)(*args), F32)


def test_attention_reads_one_layer_of_the_whole_cache(attention):
    q, kv, *rest = attention_batch([4, 1], [20, 33], group=4, head_dim=64, block_size=16, dtype=F32)
    stacked = jnp.stack([kv * 0.5, kv, kv * 2.0])  # [L, 2, NB, BS, K, D]
    out = jax.jit(lambda layer: attention(q, stacked, *rest, sm_scale=0.1, layer=layer))(
        jnp.int32(2)
    )
    expected = ragged_paged_attention_reference(q, kv * 2.0, *rest, sm_scale=0.1)
    assert_close(out, expected, F32)


@pytest.mark.parametrize("sliding_window", [None, 20])
def test_attention_at_gemma3_head_size(attention, sliding_window):
    """Gemma 3's 256-wide heads (its local layers with a window, its global ones without)."""
    args = attention_batch([1, 1, 9], [40, 17, 60], group=4, head_dim=256, block_size=16, dtype=F32)
    kwargs = dict(sm_scale=256**-0.5, sliding_window=sliding_window)
    out = jit(attention, **kwargs)(*args)
    assert_close(out, jit(ragged_paged_attention_reference, **kwargs)(*args), F32)
