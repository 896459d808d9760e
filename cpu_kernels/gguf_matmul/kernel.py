"""float32 activations times weights in llama.cpp's Q4_1 or Q8_0 block formats on XLA:CPU
through the C++ kernel in kernel.cc (layouts: reference.py).

    gguf_matmul = load_gguf_matmul(build_dir)   # compiles kernel.cc once, registers it
    y = gguf_matmul("Q4_1", x, qs, scales)                # one weight
    y = gguf_matmul("Q4_1", x, qs, scales, layer=i)       # layer i of stacked [L, N, ...] blocks

T: tokens (rows of x), K: the contracted axis, N: output rows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError, build, load, register
from cpu_kernels.gguf_matmul.reference import BLOCK, FORMATS

SOURCE = Path(__file__).with_name("kernel.cc")
TARGETS = {"Q4_1": "jaxinfer_q4_1_matmul", "Q8_0": "jaxinfer_q8_0_matmul"}
_QS_DTYPES = {"Q4_1": jnp.uint8, "Q8_0": jnp.int8}


def block_shapes(fmt: str, n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(qs shape, scales shape) of an [n, k] weight in `fmt`."""
    if fmt == "Q4_1":
        return (n, k // 2), (n, k // BLOCK, 2)
    return (n, k), (n, k // BLOCK)


def gguf_matmul(
    fmt: str,
    x: jax.Array,  # f32[T, K]
    qs: jax.Array,  # [N, ...] blocks, or [L, N, ...] with `layer`
    scales: jax.Array,
    *,
    layer: jax.Array | None = None,  # i32[]: which of the L stacked weights
) -> jax.Array:  # f32[T, N]
    """x @ W^T for W in block format `fmt` (see load_gguf_matmul)."""
    if fmt not in FORMATS:
        raise ValueError(f"block format must be one of {FORMATS}, got {fmt!r}")
    stacked = layer is not None
    n = qs.shape[1] if stacked else qs.shape[0]
    qs_shape, scales_shape = block_shapes(fmt, n, x.shape[-1])
    lead = qs.shape[:1] if stacked else ()
    if (
        x.dtype != jnp.float32
        or qs.dtype != _QS_DTYPES[fmt]
        or scales.dtype != jnp.float32
        or x.ndim != 2
        or x.shape[1] % BLOCK
        or qs.shape != (*lead, *qs_shape)
        or scales.shape != (*lead, *scales_shape)
    ):
        raise ValueError(
            f"gguf_matmul {fmt}: x f32[T, K] (K a multiple of {BLOCK}), qs "
            f"{jnp.dtype(_QS_DTYPES[fmt]).name}{list(qs_shape)}, scales f32{list(scales_shape)} "
            f"(with a leading [L] for a layer); got x {x.dtype}{list(x.shape)}, qs "
            f"{qs.dtype}{list(qs.shape)}, scales {scales.dtype}{list(scales.shape)}"
        )
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    result = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[fmt], result)(x, qs, scales, index)


def load_gguf_matmul(build_dir: Path) -> Callable:
    """`gguf_matmul`, ready to call: builds kernel.cc into `build_dir` if needed and registers
    it. KernelBuildError if the host has no C++ compiler, or a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_gguf_matmul_supported():
        raise KernelBuildError("the GGUF matmul kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferQ4_1Matmul", TARGETS["Q4_1"])
    register(library, "JaxinferQ8_0Matmul", TARGETS["Q8_0"])
    return gguf_matmul
