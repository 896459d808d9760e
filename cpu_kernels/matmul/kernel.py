"""float32 activations times "out_in" weights (float32, or int8 with per-output-channel
scales) on XLA:CPU through the C++ kernel in kernel.cc.

    matmul = load_matmul(build_dir)   # compiles kernel.cc once, registers it
    y = matmul(x, w)                  # float32 w; inside or outside jit
    y = matmul(x, q, scale)           # int8 q
    y = matmul(x, stacked, layer=i)   # layer i of stacked weights [L, *out, K], in place
    y = matmul(x, w, fixed_order=True)  # each row's sum in one order for any row count

T: tokens (rows of x), K: the contracted (input) axis, *out: the weight's output axes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError, build, load, register

SOURCE = Path(__file__).with_name("kernel.cc")
F32_TARGET, INT8_TARGET = "jaxinfer_f32_matmul", "jaxinfer_int8_matmul"


def matmul(
    x: jax.Array,  # [T, K] float32
    w: jax.Array,  # [*out, K] float32, or int8 with `scale`; [L, *out, K] with `layer`
    scale: jax.Array | None = None,  # [*out] float32 (one layer's)
    *,
    layer: jax.Array | None = None,  # i32[]: which of the L stacked weights
    fixed_order: bool = False,
) -> jax.Array:  # [T, *out] float32
    """(x @ w^T) (* scale) through the registered kernel (see load_matmul). With `layer`, w
    holds the weights of every layer and the kernel reads layer `layer` in place: under a
    layer scan, slicing it instead would copy the weight every layer. With `fixed_order`
    every output is one FMA chain over K in order, whatever the number of rows (the
    batch-invariant mode); without it up to 3 rows take a faster, differently ordered path."""
    int8 = w.dtype == jnp.int8
    if (
        x.dtype != jnp.float32
        or w.dtype not in (jnp.float32, jnp.int8)
        or int8 != (scale is not None)
    ):
        raise TypeError(
            "matmul takes float32 x with float32 w, or with int8 w and its scale; got "
            f"{x.dtype}, {w.dtype}, {None if scale is None else scale.dtype}"
        )
    out = w.shape[1:-1] if layer is not None else w.shape[:-1]
    if x.ndim != 2 or x.shape[1] != w.shape[-1] or (int8 and scale.shape != out):
        raise ValueError(
            f"matmul: x [T, K], w [*out, K] ([L, *out, K] with a layer), scale [*out]; got "
            f"{x.shape}, {w.shape}, {None if scale is None else scale.shape}"
        )
    result = jax.ShapeDtypeStruct((x.shape[0], math.prod(out)), x.dtype)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if int8:
        y = jax.ffi.ffi_call(INT8_TARGET, result)(
            x, w, scale.astype(jnp.float32), index, fixed_order=fixed_order
        )
    else:
        y = jax.ffi.ffi_call(F32_TARGET, result)(x, w, index, fixed_order=fixed_order)
    return y.reshape(x.shape[0], *out)  # [T, *out]


def load_matmul(build_dir: Path) -> Callable:
    """`matmul`, ready to call: builds kernel.cc into `build_dir` if needed and registers it.
    KernelBuildError if the host has no C++ compiler, or a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_matmul_supported():
        raise KernelBuildError("the CPU matmul kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferF32Matmul", F32_TARGET)
    register(library, "JaxinferInt8Matmul", INT8_TARGET)
    return matmul
