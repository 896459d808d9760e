"""float32 activations times int8 weights on XLA:CPU through the C++ kernel in kernel.cc.

    matmul = load_int8_matmul(build_dir)   # compiles kernel.cc once, registers it
    y = matmul(x, w, scale)                # inside or outside jit; same as the reference

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
TARGET = "jaxinfer_int8_matmul"


def int8_matmul(
    x: jax.Array,  # [T, K] float32
    w: jax.Array,  # [*out, K] int8
    scale: jax.Array,  # [*out] float32
) -> jax.Array:  # [T, *out] float32
    """(x @ w^T) * scale through the registered kernel (see load_int8_matmul)."""
    if x.dtype != jnp.float32 or w.dtype != jnp.int8 or scale.dtype != jnp.float32:
        raise TypeError(
            f"int8_matmul takes float32 x, int8 w and float32 scale; got {x.dtype}, "
            f"{w.dtype}, {scale.dtype}"
        )
    if x.ndim != 2 or x.shape[1] != w.shape[-1] or scale.shape != w.shape[:-1]:
        raise ValueError(
            f"int8_matmul: x [T, K], w [*out, K], scale [*out]; got {x.shape}, {w.shape}, "
            f"{scale.shape}"
        )
    out = w.shape[:-1]
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], math.prod(out)), x.dtype))(
        x, w, scale
    )  # [T, N]
    return y.reshape(x.shape[0], *out)


def load_int8_matmul(build_dir: Path) -> Callable:
    """int8_matmul, ready to call: builds kernel.cc into `build_dir` if needed and registers
    it. KernelBuildError if the host has no C++ compiler, or a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_int8_matmul_supported():
        raise KernelBuildError("the int8 CPU kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferInt8Matmul", TARGET)
    return int8_matmul
