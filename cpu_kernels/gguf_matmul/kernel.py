"""float32 activations times weights in llama.cpp's block formats, read as a GGUF file stores
them, on XLA:CPU through the C++ kernel in kernel.cc (layouts: reference.py).

    load_gguf_matmul(build_dir)     # compiles kernel.cc once, registers it
    y = gguf_matmul(x, data, table, layer)                          # exact float activations
    y = gguf_matmul(x, data, table, layer, int8_activations=True)   # llama.cpp's integer dots
    rows = gguf_rows(ids, data, table, layer, k)   # exact rows (an embedding lookup)

data u8[L, B] and table i32[L, S, 3] hold every layer of a weight kind; `layer` (an i32
scalar, traced under a layer scan) picks one, read in place. M: rows of x, K: the contracted
axis, N: output rows (the segments' rows summed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError, build, cpu_features, load, register

SOURCE = Path(__file__).with_name("kernel.cc")
MATMUL_TARGET, ROWS_TARGET = "jaxinfer_gguf_matmul", "jaxinfer_gguf_rows"
VNNI512_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


def has_avx512_vnni() -> bool:
    """Whether this CPU takes the kernel's AVX-512 paths (they need VNNI as well as F, BW, VL
    and DQ); without them every path is AVX2."""
    return all(f in cpu_features() for f in VNNI512_FEATURES)


def _check(data: jax.Array, table: jax.Array, name: str) -> None:
    if (
        data.dtype != jnp.uint8
        or data.ndim != 2
        or table.dtype != jnp.int32
        or table.ndim != 3
        or table.shape[0] != data.shape[0]
        or table.shape[2] != 3
    ):
        raise ValueError(
            f"{name}: data u8[L, B] and table i32[L, S, 3]; got data "
            f"{data.dtype}{list(data.shape)}, table {table.dtype}{list(table.shape)}"
        )


def gguf_matmul(
    x: jax.Array,  # f32[M, K]
    data: jax.Array,  # u8[L, B]
    table: jax.Array,  # i32[L, S, 3]
    layer: jax.Array | int,  # i32[]
    *,
    n: int,  # output rows (the layer's segments' rows summed)
    int8_activations: bool = False,
    avx512_vnni: bool | None = None,
    valid: jax.Array | int | None = None,  # i32[]: rows of x that are not padding
) -> jax.Array:  # f32[M, N]
    """x @ W^T for layer `layer` of a block weight (see load_gguf_matmul): exact, or with x
    rounded to int8 per block and integer dot products (llama.cpp's). `avx512_vnni`: whether
    the kernel takes its AVX-512 paths (integer products through VNNI, the exact mode's wider
    tiles; default: where the CPU has them; the kernel refuses them on a CPU without).
    `valid`: the first rows of x that are real (a step's tokens before its padding), the
    others' outputs zeros and not computed; default all."""
    _check(data, table, "gguf_matmul")
    if x.dtype != jnp.float32 or x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(
            f"gguf_matmul: x f32[M, K], K a multiple of 32; got {x.dtype}{list(x.shape)}"
        )
    result = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    index = jnp.asarray(layer, jnp.int32)
    vnni = has_avx512_vnni() if avx512_vnni is None else avx512_vnni
    rows = jnp.asarray(x.shape[0] if valid is None else valid, jnp.int32)
    return jax.ffi.ffi_call(MATMUL_TARGET, result)(
        x, data, table, index, rows, int8_activations=int8_activations, avx512_vnni=vnni
    )


def gguf_rows(
    ids: jax.Array,  # i32[T]
    data: jax.Array,  # u8[L, B]
    table: jax.Array,  # i32[L, S, 3]
    layer: jax.Array | int,
    *,
    k: int,
) -> jax.Array:  # f32[T, K]
    """Rows `ids` of layer `layer`'s weight, dequantized exactly (ids clamped into range)."""
    _check(data, table, "gguf_rows")
    result = jax.ShapeDtypeStruct((ids.shape[0], k), jnp.float32)
    index = jnp.asarray(layer, jnp.int32)
    return jax.ffi.ffi_call(ROWS_TARGET, result)(ids.astype(jnp.int32), data, table, index)


def load_gguf_matmul(build_dir: Path) -> Callable:
    """`gguf_matmul`, ready to call (and `gguf_rows`): builds kernel.cc into `build_dir` if
    needed and registers it. KernelBuildError if the host has no C++ compiler, or a CPU
    without AVX2, FMA and F16C."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_gguf_matmul_supported():
        raise KernelBuildError("the GGUF matmul kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferGGUFMatmul", MATMUL_TARGET)
    register(library, "JaxinferGGUFRows", ROWS_TARGET)
    return gguf_matmul
