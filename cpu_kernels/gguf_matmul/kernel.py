"""float32 activations times weights in llama.cpp's block formats, read as a GGUF file stores
them, on XLA:CPU through the C++ kernel in kernel.cc (layouts: reference.py).

    load_gguf_matmul(build_dir)     # compiles kernel.cc once, registers it
    y = gguf_matmul(x, data, table, layer)                          # exact float activations
    y = gguf_matmul(x, data, table, layer, int8_activations=True)   # llama.cpp's integer dots
    rows = gguf_rows(ids, data, table, layer, k)   # exact rows (an embedding lookup)
    y = gguf_grouped_matmul(x, data, table, layer, group_sizes, n=n)  # a MoE layer's experts

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
GROUPED_TARGET = "jaxinfer_gguf_grouped_matmul"
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


def gguf_grouped_matmul(
    x: jax.Array,  # f32[M, K] rows sorted by group; [X, K] with x_rows
    data: jax.Array,  # u8[L G, B]: layer l's expert g at l * G + g
    table: jax.Array,  # i32[L G, S, 3]
    layer: jax.Array | int,  # i32[]
    group_sizes: jax.Array,  # i32[G], summing to at most M
    *,
    n: int,  # output rows of each expert's weight
    x_rows: jax.Array | None = None,  # i32[M]: product row r reads x[x_rows[r]]
    y_rows: jax.Array | None = None,  # i32[M], a permutation: row r is written to y[y_rows[r]]
    int8_activations: bool = False,
    avx512_vnni: bool | None = None,
) -> jax.Array:  # f32[M, N]
    """A MoE layer's experts kept in blocks: product rows offsets[g] .. offsets[g] +
    group_sizes[g] times expert g of layer `layer` (as `gguf_matmul` multiplies, each group's
    x rounded on its own in the int8 mode), rows after the last group zeros; x_rows and y_rows
    gather and scatter the rows inside the kernel (cpu_kernels.matmul.kernel.grouped_matmul's
    convention)."""
    _check(data, table, "gguf_grouped_matmul")
    rows = x.shape[0] if x_rows is None else x_rows.shape[0]
    groups = group_sizes.shape[0] if group_sizes.ndim == 1 else 0
    if (
        x.dtype != jnp.float32
        or x.ndim != 2
        or x.shape[1] % 32
        or not groups
        or data.shape[0] % groups
        or (y_rows is not None and y_rows.shape != (rows,))
    ):
        raise ValueError(
            "gguf_grouped_matmul: x f32[M, K] (K a multiple of 32), data u8[L G, B], "
            f"group_sizes [G], x_rows and y_rows [M]; got x {x.dtype}{list(x.shape)}, data "
            f"{list(data.shape)}, group_sizes {list(group_sizes.shape)}, x_rows "
            f"{None if x_rows is None else list(x_rows.shape)}, y_rows "
            f"{None if y_rows is None else list(y_rows.shape)}"
        )
    none = jnp.zeros((0,), jnp.int32)
    vnni = has_avx512_vnni() if avx512_vnni is None else avx512_vnni
    return jax.ffi.ffi_call(GROUPED_TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32))(
        x,
        data,
        table,
        jnp.asarray(layer, jnp.int32),
        group_sizes.astype(jnp.int32),
        none if x_rows is None else x_rows.astype(jnp.int32),
        none if y_rows is None else y_rows.astype(jnp.int32),
        int8_activations=int8_activations,
        avx512_vnni=vnni,
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
    """`gguf_matmul`, ready to call (and `gguf_rows`, `gguf_grouped_matmul`): builds kernel.cc into `build_dir` if
    needed and registers it. KernelBuildError if the host has no C++ compiler, or a CPU
    without AVX2, FMA and F16C."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_gguf_matmul_supported():
        raise KernelBuildError("the GGUF matmul kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferGGUFMatmul", MATMUL_TARGET)
    register(library, "JaxinferGGUFRows", ROWS_TARGET)
    register(library, "JaxinferGGUFGroupedMatmul", GROUPED_TARGET)
    return gguf_matmul
