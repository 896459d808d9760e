"""float32 activations times "out_in" weights (float32, or int8 with per-output-channel
scales) on XLA:CPU through the C++ kernel in kernel.cc.

    matmul = load_matmul(build_dir)   # compiles kernel.cc once, registers it
    y = matmul(x, w)                  # float32 w; inside or outside jit
    y = matmul(x, q, scale)           # int8 q
    y = matmul(x, stacked, layer=i)   # layer i of stacked weights [L, *out, K], in place
    y = matmul(x, w, fixed_order=True)  # each row's sum in one order for any row count
    y = grouped_matmul(x, w, group_sizes)  # rows sorted by group, w [G, *out, K]
    y = int4_matmul(x, qs, scale, bias)    # 4-bit groups (pallas_kernels/int4_matmul)

T: tokens (rows of x), K: the contracted (input) axis, *out: the weight's output axes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError, build, cpu_features, load, register

SOURCE = Path(__file__).with_name("kernel.cc")
F32_TARGET, INT8_TARGET = "jaxinfer_f32_matmul", "jaxinfer_int8_matmul"
F32_GROUPED, INT8_GROUPED = "jaxinfer_f32_grouped_matmul", "jaxinfer_int8_grouped_matmul"
INT4_TARGET, INT4_GROUPED = "jaxinfer_int4_matmul", "jaxinfer_int4_grouped_matmul"


def has_avx512() -> bool:
    """Whether this CPU has AVX-512F (the int4 kernel's faster streaming path)."""
    return "avx512f" in cpu_features()


def _is_int8(x: jax.Array, w: jax.Array, scale: jax.Array | None, name: str) -> bool:
    """Whether w is int8 (with its scale); a TypeError unless x is float32 and w float32, or
    int8 with a scale."""
    int8 = w.dtype == jnp.int8
    if (
        x.dtype != jnp.float32
        or w.dtype not in (jnp.float32, jnp.int8)
        or int8 != (scale is not None)
    ):
        raise TypeError(
            f"{name} takes float32 x with float32 w, or with int8 w and its scale; got "
            f"{x.dtype}, {w.dtype}, {None if scale is None else scale.dtype}"
        )
    return int8


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
    int8 = _is_int8(x, w, scale, "matmul")
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


def grouped_matmul(
    x: jax.Array,  # [M, K] float32 rows sorted by group; [X, K] with x_rows
    w: jax.Array,  # [G, *out, K] float32, or int8 with `scale`; [L, G, *out, K] with `layer`
    group_sizes: jax.Array,  # i32[G], summing to at most M
    scale: jax.Array | None = None,  # [G, *out] float32 (one layer's)
    *,
    x_rows: jax.Array | None = None,  # i32[M]: row r of the product reads x[x_rows[r]]
    y_rows: jax.Array | None = None,  # i32[M], a permutation: row r is written to y[y_rows[r]]
    layer: jax.Array | None = None,
    fixed_order: bool = False,
) -> jax.Array:  # [M, *out] float32
    """Each group's rows times its own weight (the experts of a MoE layer): product rows
    offsets[g] .. offsets[g] + group_sizes[g] by w[g], product rows after the last group zero
    (as pallas_kernels.grouped_matmul.reference, on "out_in" weights). `x_rows` gathers the
    product's rows from x and `y_rows` scatters them into y inside the kernel (a MoE layer's
    tokens to their sorted rows and back, without materializing either copy). Each group
    runs as `matmul` over its rows, with the same paths and `fixed_order`."""
    int8 = _is_int8(x, w, scale, "grouped_matmul")
    lead = 2 if layer is not None else 1
    groups, out = w.shape[lead - 1], w.shape[lead:-1]
    rows = x.shape[0] if x_rows is None else x_rows.shape[0]
    if (
        x.ndim != 2
        or x.shape[1] != w.shape[-1]
        or group_sizes.shape != (groups,)
        or (int8 and scale.shape != (groups, *out))
        or (y_rows is not None and y_rows.shape != (rows,))
    ):
        raise ValueError(
            "grouped_matmul: x [M, K], w [G, *out, K] ([L, G, *out, K] with a layer), "
            "group_sizes [G], scale [G, *out], x_rows and y_rows [M]; got "
            f"{x.shape}, {w.shape}, {group_sizes.shape}, "
            f"{None if scale is None else scale.shape}, "
            f"{None if x_rows is None else x_rows.shape}, "
            f"{None if y_rows is None else y_rows.shape}"
        )
    n = math.prod(out)
    w = w.reshape(*w.shape[:lead], n, w.shape[-1])
    result = jax.ShapeDtypeStruct((rows, n), x.dtype)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    sizes = group_sizes.astype(jnp.int32)
    none = jnp.zeros((0,), jnp.int32)
    x_rows = none if x_rows is None else x_rows.astype(jnp.int32)
    y_rows = none if y_rows is None else y_rows.astype(jnp.int32)
    if int8:
        scale = scale.reshape(groups, n).astype(jnp.float32)
        y = jax.ffi.ffi_call(INT8_GROUPED, result)(
            x, w, scale, sizes, x_rows, y_rows, index, fixed_order=fixed_order
        )
    else:
        y = jax.ffi.ffi_call(F32_GROUPED, result)(
            x, w, sizes, x_rows, y_rows, index, fixed_order=fixed_order
        )
    return y.reshape(rows, *out)


def int4_matmul(
    x: jax.Array,  # [T, K] float32
    qs: jax.Array,  # u8[*out, K / 2]; [L, *out, K / 2] with `layer`
    scale: jax.Array,  # [*out, K / G] float32 or float16 ([L, ...] with `layer`)
    bias: jax.Array,  # the same
    *,
    layer: jax.Array | None = None,  # i32[]: which of the L stacked weights
    fixed_order: bool = False,
    int8_activations: bool = False,
    avx512: bool | None = None,
) -> jax.Array:  # [T, *out] float32
    """x @ W^T for 4-bit weights in groups (format: pallas_kernels.int4_matmul.reference).
    Up to 4 rows of x stream the packed weight: the values are unpacked in registers and the
    group's scale and bias factored out of its sums, so nothing is dequantized to memory; more
    rows dequantize tiles of the weight to float32 for the outer-product path (as int8 does).
    `int8_activations` rounds the streamed rows of x to int8 per run of 32 values and sums in
    integers (llama.cpp's approach: faster, numerics differ by the rounding of x). With
    `fixed_order` every row count takes the outer-product path (batch-invariant). `avx512`:
    the streamed exact rows through the AVX-512 path (table lookups; the same values, summed
    in another order), by default where the CPU has AVX-512F; the AVX2 path otherwise."""
    lead = 1 if layer is not None else 0
    out = qs.shape[lead:-1]
    k = x.shape[-1]
    if (
        x.dtype != jnp.float32
        or qs.dtype != jnp.uint8
        or scale.dtype not in (jnp.float32, jnp.float16)
        or bias.dtype not in (jnp.float32, jnp.float16)
        or x.ndim != 2
        or k % 32
        or qs.shape[-1] * 2 != k
        or scale.shape != bias.shape
        or scale.shape[:-1] != qs.shape[:-1]
        or k % scale.shape[-1]
        or (k // scale.shape[-1]) % 32
    ):
        raise ValueError(
            "int4_matmul: x f32[T, K] (K a multiple of 32), qs u8[*out, K / 2], scale and bias "
            "[*out, K / G] float32 or float16 (G a multiple of 32; a leading [L] with a layer); "
            f"got x {x.dtype}{list(x.shape)}, qs {qs.dtype}{list(qs.shape)}, scale "
            f"{scale.dtype}{list(scale.shape)}, bias {bias.dtype}{list(bias.shape)}"
        )
    result = jax.ShapeDtypeStruct((x.shape[0], math.prod(out)), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    y = jax.ffi.ffi_call(INT4_TARGET, result)(
        x,
        qs,
        scale,
        bias,
        index,
        fixed_order=fixed_order,
        int8_activations=int8_activations,
        avx512=has_avx512() if avx512 is None else avx512,
    )
    return y.reshape(x.shape[0], *out)


def grouped_int4_matmul(
    x: jax.Array,  # [M, K] float32 rows sorted by group; [X, K] with x_rows
    qs: jax.Array,  # u8[G, *out, K / 2]; [L, G, *out, K / 2] with `layer`
    scale: jax.Array,  # [G, *out, K / S] float32 or float16 ([L, ...] with `layer`)
    bias: jax.Array,
    group_sizes: jax.Array,  # i32[G]
    *,
    x_rows: jax.Array | None = None,
    y_rows: jax.Array | None = None,
    layer: jax.Array | None = None,
    fixed_order: bool = False,
    int8_activations: bool = False,
    avx512: bool | None = None,
) -> jax.Array:  # [M, *out] float32
    """grouped_matmul for int4 experts (each group's rows as int4_matmul over its weight)."""
    lead = 2 if layer is not None else 1
    groups, out = qs.shape[lead - 1], qs.shape[lead:-1]
    rows = x.shape[0] if x_rows is None else x_rows.shape[0]
    if (
        x.dtype != jnp.float32
        or qs.dtype != jnp.uint8
        or x.ndim != 2
        or x.shape[1] != 2 * qs.shape[-1]
        or scale.shape != bias.shape
        or scale.shape[:-1] != qs.shape[:-1]
        or group_sizes.shape != (groups,)
        or (y_rows is not None and y_rows.shape != (rows,))
    ):
        raise ValueError(
            "grouped_int4_matmul: x f32[M, K], qs u8[G, *out, K / 2], scale and bias "
            f"[G, *out, K / S], group_sizes [G]; got {x.dtype}{list(x.shape)}, "
            f"{qs.dtype}{list(qs.shape)}, {list(scale.shape)}, {list(bias.shape)}, "
            f"{list(group_sizes.shape)}"
        )
    n = math.prod(out)
    qs = qs.reshape(*qs.shape[:lead], n, qs.shape[-1])
    scale = scale.reshape(*scale.shape[:lead], n, scale.shape[-1])
    bias = bias.reshape(*bias.shape[:lead], n, bias.shape[-1])
    none = jnp.zeros((0,), jnp.int32)
    y = jax.ffi.ffi_call(INT4_GROUPED, jax.ShapeDtypeStruct((rows, n), jnp.float32))(
        x,
        qs,
        scale,
        bias,
        group_sizes.astype(jnp.int32),
        none if x_rows is None else x_rows.astype(jnp.int32),
        none if y_rows is None else y_rows.astype(jnp.int32),
        jnp.asarray(0 if layer is None else layer, jnp.int32),
        fixed_order=fixed_order,
        int8_activations=int8_activations,
        avx512=has_avx512() if avx512 is None else avx512,
    )
    return y.reshape(rows, *out)


def load_matmul(build_dir: Path) -> Callable:
    """`matmul`, ready to call: builds kernel.cc into `build_dir` if needed and registers it.
    KernelBuildError if the host has no C++ compiler, or a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_matmul_supported():
        raise KernelBuildError("the CPU matmul kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferF32Matmul", F32_TARGET)
    register(library, "JaxinferInt8Matmul", INT8_TARGET)
    register(library, "JaxinferF32GroupedMatmul", F32_GROUPED)
    register(library, "JaxinferInt8GroupedMatmul", INT8_GROUPED)
    register(library, "JaxinferInt4Matmul", INT4_TARGET)
    register(library, "JaxinferInt4GroupedMatmul", INT4_GROUPED)
    return matmul
