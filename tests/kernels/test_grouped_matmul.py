"""The grouped matmul (a MoE layer's experts) against numpy: the C++ kernel (float32 and int8
weights, one layer of a stack read in place, the fixed order) and the Pallas kernel through
Pallas' interpreter, plus its lowering for the GPU.

Rows of x are sorted by group; group g's rows are multiplied by w[g]; rows after the last group
are zero."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_lowering
from pallas_kernels.grouped_matmul.kernel import grouped_matmul as pallas_grouped
from pallas_kernels.grouped_matmul.reference import (
    grouped_matmul_out_in_reference,
    grouped_matmul_reference,
)


def numpy_grouped(x, w, sizes, scale=None):  # w [G, K, N] ("in_out")
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    row = 0
    for g, size in enumerate(np.asarray(sizes)):
        y[row : row + size] = x[row : row + size] @ w[g]
        if scale is not None:
            y[row : row + size] *= np.asarray(scale, np.float64)[g]
        row += size
    return y


# (rows, groups, K, N, group sizes): empty groups, rows past the last group, groups of 1-3 rows
# (the C++ kernel's streaming path) and of more (its outer-product path), K and N off the
# kernels' tiles.
CASES = [
    (40, 6, 32, 48, [5, 0, 17, 0, 3, 10]),
    (8, 8, 64, 40, [1] * 8),
    (3, 4, 16, 16, [0, 0, 0, 2]),
    (70, 3, 37, 19, [33, 2, 30]),
    (16, 5, 48, 64, [0, 0, 0, 0, 0]),
]


def _case(rows, groups, depth, outputs, sizes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    w = rng.standard_normal((groups, depth, outputs)).astype(np.float32)
    return x, w, np.asarray(sizes, np.int32)


@pytest.mark.parametrize("case", CASES, ids=[f"M{c[0]}-G{c[1]}-K{c[2]}-N{c[3]}" for c in CASES])
def test_references_agree_with_numpy(case):
    x, w, sizes = _case(*case)
    expected = numpy_grouped(x, w, sizes)
    np.testing.assert_allclose(grouped_matmul_reference(x, w, sizes), expected, atol=1e-4)
    out_in = np.swapaxes(w, 1, 2)
    np.testing.assert_allclose(
        grouped_matmul_out_in_reference(x, out_in, sizes), expected, atol=1e-4
    )


@pytest.mark.parametrize("case", CASES, ids=[f"M{c[0]}-G{c[1]}-K{c[2]}-N{c[3]}" for c in CASES])
def test_cpu_kernel(cpu_matmul, case):
    from cpu_kernels.matmul.kernel import grouped_matmul

    x, w, sizes = _case(*case)
    out_in = np.ascontiguousarray(np.swapaxes(w, 1, 2))  # [G, N, K]
    y = jax.jit(grouped_matmul)(x, out_in, sizes)
    np.testing.assert_allclose(y, numpy_grouped(x, w, sizes), rtol=1e-5, atol=1e-4)
    # int8 weights with a scale per group and output
    rng = np.random.default_rng(1)
    q = rng.integers(-127, 128, out_in.shape).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, out_in.shape[:2]).astype(np.float32)
    y = jax.jit(grouped_matmul)(x, q, sizes, scale)
    expected = numpy_grouped(x, np.swapaxes(q, 1, 2), sizes, scale)
    # up to 3 rows of a group are rounded to int16 (relative 1.5e-5 of each row's largest)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())
    # one layer of a stack [L, G, N, K], read in place
    stacked = np.stack([out_in * 0.5, out_in])
    y = jax.jit(lambda x, w, s, i: grouped_matmul(x, w, s, layer=i))(x, stacked, sizes, 1)
    np.testing.assert_allclose(y, numpy_grouped(x, w, sizes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_cpu_kernel_gathers_and_scatters_rows(cpu_matmul, int8):
    """x_rows: product row r reads x[x_rows[r]] (tokens to sorted rows); y_rows: it is
    written to y[y_rows[r]] (back to the tokens' order); rows after the groups are zero at
    their destinations. Groups of 1-8 rows stream the weight, larger ones do not."""
    from cpu_kernels.matmul.kernel import grouped_matmul

    rng = np.random.default_rng(5)
    tokens, rows, depth, outputs = 9, 40, 48, 24
    sizes = np.asarray([5, 8, 0, 12, 1, 9], np.int32)  # 35 of 40 rows
    x = rng.standard_normal((tokens, depth)).astype(np.float32)
    w = rng.standard_normal((6, outputs, depth)).astype(np.float32)  # "out_in"
    scale = None
    if int8:
        w = rng.integers(-127, 128, w.shape).astype(np.int8)
        scale = rng.uniform(0.01, 0.02, (6, outputs)).astype(np.float32)
    x_rows = rng.integers(0, tokens, rows).astype(np.int32)
    y_rows = rng.permutation(rows).astype(np.int32)
    y = jax.jit(grouped_matmul)(x, w, sizes, scale, x_rows=x_rows, y_rows=y_rows)
    sorted_rows = numpy_grouped(x[x_rows], np.swapaxes(w, 1, 2), sizes, scale)
    expected = np.zeros_like(sorted_rows)
    expected[y_rows] = sorted_rows
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-3 * np.abs(expected).max())
    assert not np.asarray(y)[y_rows[35:]].any()


def test_cpu_kernel_fixed_order_rows_do_not_depend_on_their_group(cpu_matmul):
    """With fixed_order a row's result is the same bits in a group of 1 row or of 40."""
    from cpu_kernels.matmul.kernel import grouped_matmul

    x, w, _ = _case(41, 2, 96, 64, [1, 40])
    out_in = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    call = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, fixed_order=True))
    together = np.asarray(call(x, out_in, np.asarray([0, 41], np.int32)))
    alone = np.asarray(call(x[:1], out_in, np.asarray([0, 1], np.int32)))
    np.testing.assert_array_equal(together[:1], alone)


def test_cpu_kernel_refuses_bad_shapes(cpu_matmul):
    from cpu_kernels.matmul.kernel import grouped_matmul

    x, w, sizes = _case(*CASES[0])
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, np.swapaxes(w, 1, 2), sizes[:-1])
    with pytest.raises(TypeError):
        grouped_matmul(x, np.swapaxes(w, 1, 2).astype(np.int8), sizes)  # int8 needs a scale


PALLAS_CASES = [c for c in CASES if c[2] % 16 == 0 and c[3] % 16 == 0]


@pytest.mark.parametrize(
    "case", PALLAS_CASES, ids=[f"M{c[0]}-G{c[1]}-K{c[2]}-N{c[3]}" for c in PALLAS_CASES]
)
def test_pallas_kernel_interpret(case):
    x, w, sizes = _case(*case)
    kernel = jax.jit(functools.partial(pallas_grouped, interpret=True, block_n=16, block_k=16))
    y = kernel(x, w, sizes)
    np.testing.assert_allclose(y, numpy_grouped(x, w, sizes), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_pallas_kernel_int8_and_bfloat16_interpret():
    x, w, sizes = _case(40, 6, 32, 48, [5, 0, 17, 0, 3, 10])
    q = np.clip(np.rint(w * 40), -127, 127).astype(np.int8)
    y = pallas_grouped(x, q, sizes, interpret=True, block_m=16, block_n=16, block_k=16)
    np.testing.assert_allclose(y, numpy_grouped(x, q, sizes), rtol=1e-5, atol=1e-3)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    y = pallas_grouped(xb, wb, sizes, interpret=True, block_n=16, block_k=16)
    expected = numpy_grouped(np.asarray(xb, np.float32), np.asarray(wb, np.float32), sizes)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=2e-2, atol=5e-2)


def test_pallas_kernel_lowers_for_the_gpu():
    for hidden, intermediate in [(576, 256), (2048, 768)]:
        x = jnp.zeros((64 * 8, hidden), jnp.bfloat16)
        w = jnp.zeros((64, hidden, 2 * intermediate), jnp.bfloat16)
        sizes = jnp.zeros(64, jnp.int32)
        text = gpu_lowering.lower_for_gpu(pallas_grouped, x, w, sizes)
        calls = gpu_lowering.custom_calls(text)
        assert calls.count(gpu_lowering.triton_custom_call()) == 1
