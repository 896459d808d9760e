"""The C++ kernel's grouped product for a MoE layer's experts kept in GGUF blocks
(cpu_kernels.gguf_matmul.kernel.gguf_grouped_matmul): each group of rows times its own
expert's blocks, against float64 numpy over gguf's dequantized weights, in every activation
mode, with the rows gathered and scattered inside the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.build import can_build
from cpu_kernels.gguf_matmul.kernel import gguf_grouped_matmul
from cpu_kernels.gguf_matmul.reference import (
    INTERLEAVE,
    gguf_grouped_matmul_reference,
    pack_layers,
    random_rows,
)
from tests.kernels.test_gguf_matmul import MODE_PARAMS, MODES

pytestmark = pytest.mark.skipif(
    not can_build(), reason="no C++ compiler, or a CPU without AVX2/FMA"
)

LAYERS, GROUPS, N, K = 2, 4, 48, 256
# Each expert's formats (a Q4_K_M-like mix; interleaved tiles beside the file's rows).
EXPERT_FORMATS = [("Q4_K",), ("Q6_K", "Q8_0"), ("Q4_K_X16",), ("Q4_0", "Q5_K")]


def experts(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(data u8[L G, B], table i32[L G, S, 3]): layer l's expert g at l * G + g, its rows in
    one or two formats."""
    rng = np.random.default_rng(seed)
    weights = []
    for _ in range(LAYERS):
        for formats in EXPERT_FORMATS:
            parts, rows = [], N // len(formats)
            for fmt in formats:
                if fmt in INTERLEAVE:
                    parts.append(
                        (fmt, INTERLEAVE[fmt](random_rows(fmt.removesuffix("_X16"), rows, K, rng)))
                    )
                else:
                    parts.append((fmt, random_rows(fmt, rows, K, rng)))
            weights.append(parts)
    return pack_layers(weights)


@pytest.mark.parametrize("mode", MODE_PARAMS)
@pytest.mark.parametrize(
    "sizes",
    [(1, 0, 0, 0), (0, 1, 1, 0), (2, 0, 3, 1), (20, 11, 0, 9), (0, 0, 0, 0)],
    ids=["one", "two", "decode", "prefill", "none"],
)
def test_each_group_takes_its_own_expert(cpu_gguf_matmul, mode, sizes):
    """Groups of 1 to 20 rows (the streamed and the many-row paths), empty experts, rows past
    the last group (zeros), layer 1 chosen under jit; plain, gathered by x_rows and scattered
    by y_rows."""
    data, table = experts(seed=sum(sizes))
    m = sum(sizes) + 3  # rows past the last group
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, K)).astype(np.float32)
    group_sizes = np.asarray(sizes, np.int32)
    x_rows = rng.integers(0, m, m).astype(np.int32)
    y_rows = rng.permutation(m).astype(np.int32)
    int8 = MODES[mode]["int8_activations"]

    @jax.jit
    def run(x, layer, x_rows, y_rows):
        return gguf_grouped_matmul(
            x,
            data,
            table,
            layer,
            jnp.asarray(group_sizes),
            n=N,
            x_rows=x_rows,
            y_rows=y_rows,
            **MODES[mode],
        )

    for gather, scatter in [(None, None), (x_rows, y_rows)]:
        ours = np.asarray(run(jnp.asarray(x), jnp.int32(1), gather, scatter))
        theirs = gguf_grouped_matmul_reference(
            x, data, table, 1, group_sizes, int8, x_rows=gather, y_rows=scatter
        )
        assert ours.shape == (m, N)
        scale = max(np.abs(theirs).max(), 1.0)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)
        last = np.arange(sum(sizes), m)
        assert not ours[last if scatter is None else y_rows[last]].any()


def test_layer_zero_is_not_layer_one(cpu_gguf_matmul):
    """Each layer's experts are its own (layer * G + g)."""
    data, table = experts()
    x = np.random.default_rng(3).standard_normal((4, K)).astype(np.float32)
    sizes = np.asarray([1, 1, 1, 1], np.int32)
    for layer in range(LAYERS):
        ours = gguf_grouped_matmul(jnp.asarray(x), data, table, layer, jnp.asarray(sizes), n=N)
        theirs = gguf_grouped_matmul_reference(x, data, table, layer, sizes)
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-4)
    zero = gguf_grouped_matmul_reference(x, data, table, 0, sizes)
    assert not np.allclose(zero, gguf_grouped_matmul_reference(x, data, table, 1, sizes))


def test_bad_arguments_are_clear_errors(cpu_gguf_matmul):
    data, table = experts()
    x = jnp.ones((4, K), jnp.float32)
    sizes = jnp.asarray([4, 0, 0, 0], jnp.int32)
    with pytest.raises(ValueError, match="gguf_grouped_matmul"):
        gguf_grouped_matmul(x, data, table, 0, jnp.asarray([4, 0, 0], jnp.int32), n=N)
    with pytest.raises(ValueError, match="gguf_grouped_matmul"):
        gguf_grouped_matmul(x, data, table, 0, sizes, n=N, y_rows=jnp.arange(3))
    with pytest.raises(Exception, match="x_rows out of range"):
        bad = jnp.asarray([0, 1, 2, 9], jnp.int32)
        np.asarray(gguf_grouped_matmul(x, data, table, 0, sizes, n=N, x_rows=bad))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(gguf_grouped_matmul(x, data, table, LAYERS, sizes, n=N))
