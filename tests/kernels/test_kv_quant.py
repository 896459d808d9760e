"""The quantized KV-cache formats (issue 24's groundwork) against numpy (ml_dtypes for fp8):
int8 per token and head within half a step of every value (outlier channels included), fp8 bit
for bit numpy's cast of the clipped, scaled values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.kv_quant import (
    dequantize,
    fp8_scale,
    quantize_fp8,
    quantize_int8,
)


def keys(seed: int = 0, outliers: bool = False) -> np.ndarray:  # f32[T, K, D]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((37, 4, 64)).astype(np.float32)
    x[5] = 0.0  # an all-zero token
    if outliers:
        x[:, :, [3, 17]] *= 100.0  # a few channels 100x the others, as real keys have
    return x


@pytest.mark.parametrize("outliers", [False, True])
def test_int8_matches_numpy_and_is_within_half_a_step(outliers):
    x = keys(outliers=outliers)
    q, scale = quantize_int8(x)
    amax = np.abs(x).max(axis=-1)
    expected_scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    # (XLA may divide by multiplying with the reciprocal: an ulp apart, a rounding tie apart)
    np.testing.assert_allclose(np.asarray(scale), expected_scale, rtol=1e-6)
    expected_q = np.clip(np.rint(x / expected_scale[..., None]), -127, 127).astype(np.int8)
    differ = np.asarray(q).astype(np.int32) - expected_q
    assert np.abs(differ).max() <= 1 and np.count_nonzero(differ) <= differ.size // 1000
    error = np.abs(np.asarray(dequantize(q, scale)) - x)
    assert np.all(error <= expected_scale[..., None] * 0.5 * (1 + 1e-4))
    assert not np.asarray(dequantize(q, scale))[5].any()


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("fp8_e4m3", ml_dtypes.float8_e4m3fn), ("fp8_e5m2", ml_dtypes.float8_e5m2)],
)
def test_fp8_matches_numpys_cast_and_never_overflows(kind, dtype):
    x = keys(1, outliers=True)
    calibration = x[:20]
    scale = np.asarray(fp8_scale(np.abs(calibration).max(axis=(0, 2)), kind))
    limit = float(ml_dtypes.finfo(dtype).max)
    np.testing.assert_allclose(np.abs(calibration).max(axis=(0, 2)) / scale, limit, rtol=1e-6)
    x[30] *= 50.0  # past what calibration saw: clipped, not inf or NaN
    q = np.asarray(quantize_fp8(x, scale, kind))
    expected = np.clip(x / scale[:, None], -limit, limit).astype(dtype)
    np.testing.assert_array_equal(q.view(np.uint8), expected.view(np.uint8))
    restored = np.asarray(dequantize(q, scale))
    assert np.isfinite(restored).all()
    np.testing.assert_allclose(restored, expected.astype(np.float32) * scale[:, None], rtol=1e-6)
