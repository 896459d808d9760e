"""Where the C++ kernels for XLA:CPU (cpu_kernels, through the XLA FFI) replace XLA's ops.

Both need XLA:CPU, float32 activations and one device (XLA cannot split a custom call over a
mesh), and a C++ compiler to build them once into `<cache_dir>/cpu_kernels`.

matmul_impl, for the "out_in" projections and LM head (cpu_kernels.matmul):
- "xla": XLA's own ops (jaxinfer.layers.linear): W @ x^T between materialized transposes, and
  for int8 weights a convert fused into the dot (or a multiply and a sum for one row).
- "cpu": the kernel, on float32 or int8 weights: token-major in and out (no transposes), int8
  read as int8. Also needs the "out_in" layout.
- "auto": "cpu" for int8 weights wherever it can run, else "xla". For float32 weights the
  kernel's gain was within the machine's drift (the whole workload 3-6% faster in two runs,
  the 32-row layers once slower: 82 against 67 ms), while for int8 it is what makes them pay:
  10.3 against 22.0 ms for the float32 layers at 1 row (docs/benchmarks.md).

attention_impl "cpu" (cpu_kernels.paged_attention): ragged paged attention walking each
request's blocks with an online softmax, 3-5x faster than the reference on every shape
measured. "auto" picks it on CPU wherever it runs (head_dim a multiple of 8 up to 256,
block_size up to 128), else the registry's choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError
from cpu_kernels.matmul.kernel import load_matmul
from cpu_kernels.paged_attention.kernel import load_paged_attention
from jaxinfer.layers.linear import OUT_IN

IMPLS = ("auto", "xla", "cpu")

logger = logging.getLogger(__name__)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"matmul_impl must be one of {IMPLS}, got {impl!r}")


def _common_reasons(platform: str, tensor_parallel_size: int, dtype) -> list[str]:
    reasons = []
    if platform != "cpu":
        reasons.append(f"it runs on XLA:CPU, not {platform}")
    if tensor_parallel_size != 1:
        reasons.append("it runs on one device (tensor_parallel_size=1)")
    if jnp.dtype(dtype) != jnp.float32:
        reasons.append(f"it takes float32 activations, not {jnp.dtype(dtype).name}")
    return reasons


def _load(name: str, impl: str, reasons: list[str], loader: Callable, build_dir: Path):
    """The kernel from `loader`, or None where "auto" cannot have it; "cpu" where it cannot
    run is a ValueError naming why (or KernelBuildError when it cannot be built)."""
    if reasons:
        if impl == "cpu":
            raise ValueError(f"{name} 'cpu' cannot run here: " + "; ".join(reasons))
        return None
    try:
        return loader(build_dir)
    except KernelBuildError as error:
        if impl == "cpu":
            raise
        logger.warning("C++ kernel for %s unavailable (%s); XLA runs it", name, error)
        return None


def select_matmul(
    impl: str,
    *,
    quantization: str | None,
    platform: str,
    tensor_parallel_size: int,
    weight_layout: str,
    dtype,
    build_dir: Path,
) -> Callable | None:
    """The kernel for ModelKernels.matmul, or None for XLA's ops."""
    check_impl(impl)
    if impl == "xla" or (impl == "auto" and quantization != "int8"):
        return None
    reasons = _common_reasons(platform, tensor_parallel_size, dtype)
    if weight_layout != OUT_IN:
        reasons.append("it takes the 'out_in' weight layout")
    return _load("matmul_impl", impl, reasons, load_matmul, build_dir)


def select_attention(
    impl: str,
    resolved: Callable,
    *,
    platform: str,
    tensor_parallel_size: int,
    dtype,
    head_dim: int,
    block_size: int,
    build_dir: Path,
) -> Callable:
    """ModelKernels.attention: the C++ kernel for "cpu", and for "auto" where it runs; else
    `resolved`, what the kernel registry chose."""
    if impl not in ("auto", "cpu"):
        return resolved
    reasons = _common_reasons(platform, tensor_parallel_size, dtype)
    if head_dim % 8 or head_dim > 256:
        reasons.append(f"it takes a head_dim that is a multiple of 8 up to 256, not {head_dim}")
    if block_size > 128:
        reasons.append(f"it takes a block_size up to 128, not {block_size}")
    kernel = _load("attention_impl", impl, reasons, load_paged_attention, build_dir)
    return resolved if kernel is None else kernel
