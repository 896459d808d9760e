"""The batched LoRA product against numpy (row by row, float64): the pure-JAX reference, the
C++ kernel (one layer of a stack read in place) and the Pallas kernel through Pallas'
interpreter, plus its lowering for the GPU. Rows of several slots, of none (-1), and slots
no row uses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_lowering
from pallas_kernels.lora.kernel import lora as pallas_lora
from pallas_kernels.lora.reference import lora_numpy, lora_reference

# (rows, slots, rank, in, out): ranks below and at Triton's smallest dot, sizes off the
# kernels' vector widths, one row.
CASES = [(13, 4, 8, 64, 48), (1, 2, 16, 32, 96), (37, 3, 16, 80, 40), (5, 1, 4, 19, 21)]
IDS = [f"T{c[0]}-S{c[1]}-R{c[2]}-I{c[3]}-O{c[4]}" for c in CASES]


def _case(rows, num_slots, rank, depth, outputs, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    a = rng.standard_normal((layers, num_slots, rank, depth)).astype(np.float32)
    b = rng.standard_normal((layers, num_slots, rank, outputs)).astype(np.float32)
    slots = rng.integers(-1, num_slots, rows).astype(np.int32)
    slots[0] = num_slots - 1
    return x, a, b, slots


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_agrees_with_numpy(case):
    x, a, b, slots = _case(*case)
    expected = lora_numpy(x, a[1], b[1], slots)
    y = jax.jit(functools.partial(lora_reference, layer=1))(x, a, b, slots)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(
        lora_reference(x, a[0], b[0], slots), lora_numpy(x, a[0], b[0], slots), rtol=1e-5, atol=1e-4
    )
    assert not np.asarray(y)[slots < 0].any()  # rows of the base model: exact zeros


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_kernel(cpu_kernel_dir, case):
    from cpu_kernels.lora.kernel import load_lora

    kernel = load_lora(cpu_kernel_dir)
    x, a, b, slots = _case(*case)
    y = jax.jit(lambda x, a, b, s, i: kernel(x, a, b, s, layer=i))(x, a, b, slots, 1)
    np.testing.assert_allclose(y, lora_numpy(x, a[1], b[1], slots), rtol=1e-5, atol=1e-4)
    assert not np.asarray(y)[slots < 0].any()
    np.testing.assert_allclose(
        kernel(x, a[0], b[0], slots), lora_numpy(x, a[0], b[0], slots), rtol=1e-5, atol=1e-4
    )
    # each row's result is the same whatever rows are beside it (batch-invariant)
    alone = jax.jit(lambda x, a, b, s: kernel(x, a, b, s, layer=1))(x[:1], a, b, slots[:1])
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(y)[0])


# The Pallas kernel tiles I and O by 16 or more: the cases it takes.
TILED = [c for c in CASES if c[3] % 16 == 0 and c[4] % 16 == 0]


# The fast lane takes the case of several tokens (tiles of 16 rows with padding).
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=i, marks=[] if c[0] > 1 else pytest.mark.slow)
        for c, i in zip(CASES, IDS, strict=True)
        if c in TILED
    ],
)
def test_pallas_kernel_interpreted(case):
    x, a, b, slots = _case(*case)
    y = pallas_lora(x, a, b, slots, layer=jnp.int32(1), interpret=True)
    np.testing.assert_allclose(y, lora_numpy(x, a[1], b[1], slots), rtol=1e-5, atol=1e-4)
    xb, ab, bb = (jnp.asarray(v, jnp.bfloat16) for v in (x, a[0], b[0]))
    y = pallas_lora(xb, ab, bb, slots, interpret=True)
    assert y.dtype == jnp.bfloat16
    expected = lora_numpy(*(np.asarray(v, np.float32) for v in (xb, ab, bb)), slots)
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=3e-2, atol=0.3)


def test_pallas_kernel_refuses_sizes_it_cannot_tile():
    x, a, b, slots = _case(*CASES[2])  # O = 40
    with pytest.raises(ValueError, match="by powers of two of at least 16"):
        pallas_lora(x, a[0], b[0], slots, interpret=True)


def test_pallas_kernel_lowers_for_the_gpu():
    x = jnp.zeros((64, 576), jnp.bfloat16)
    a = jnp.zeros((30, 8, 16, 576), jnp.bfloat16)
    b = jnp.zeros((30, 8, 16, 1536), jnp.bfloat16)
    slots = jnp.zeros(64, jnp.int32)
    text = gpu_lowering.lower_for_gpu(
        lambda x, a, b, s: pallas_lora(x, a, b, s, layer=jnp.int32(3)), x, a, b, slots
    )
    assert gpu_lowering.custom_calls(text).count(gpu_lowering.triton_custom_call()) == 1
