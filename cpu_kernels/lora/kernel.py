"""Batched LoRA on XLA:CPU through the C++ kernel in kernel.cc, with the signature of
pallas_kernels.lora.reference (float32):

    lora = load_lora(build_dir)         # compiles kernel.cc once, registers it
    y = lora(x, a, b, slots)            # a [S, R, I], b [S, R, O]
    y = lora(x, a, b, slots, layer=i)   # layer i of stacked pairs [L, S, ...], read in place

T: rows, I: input, O: output, S: adapter slots, R: rank, L: layers.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError, build, load, register

SOURCE = Path(__file__).with_name("kernel.cc")
TARGET = "jaxinfer_lora"


def lora(
    x: jax.Array,  # [T, I] float32
    a: jax.Array,  # [S, R, I] float32, or [L, S, R, I] with `layer`
    b: jax.Array,  # [S, R, O] float32, or [L, S, R, O] with `layer`
    slots: jax.Array,  # i32[T], -1 for none
    *,
    layer: jax.Array | None = None,  # i32[]
) -> jax.Array:  # [T, O] float32
    """Each row times its own slot's pair (zeros for slot -1), through the registered kernel
    (see load_lora)."""
    if layer is None:
        a, b = a[None], b[None]
    if x.dtype != jnp.float32 or a.dtype != jnp.float32 or b.dtype != jnp.float32:
        raise TypeError(f"the CPU LoRA kernel takes float32, got {x.dtype}, {a.dtype}, {b.dtype}")
    if x.ndim != 2 or a.ndim != 4 or b.shape[:3] != a.shape[:3] or a.shape[3] != x.shape[1]:
        raise ValueError(
            "lora: x [T, I], a [S, R, I] and b [S, R, O] ([L, ...] with a layer); got "
            f"{x.shape}, {a.shape}, {b.shape}"
        )
    result = jax.ShapeDtypeStruct((x.shape[0], b.shape[3]), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    return jax.ffi.ffi_call(TARGET, result)(x, a, b, slots.astype(jnp.int32), index)


def load_lora(build_dir: Path):
    """`lora`, ready to call: builds kernel.cc into `build_dir` if needed and registers it.
    KernelBuildError without a C++ compiler, or on a CPU without AVX2 and FMA."""
    library = build(SOURCE, build_dir)
    if not load(library).jaxinfer_lora_supported():
        raise KernelBuildError("the CPU LoRA kernel needs a CPU with AVX2 and FMA")
    register(library, "JaxinferLora", TARGET)
    return lora
