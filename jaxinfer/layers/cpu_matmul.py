"""Which implementation computes the "out_in" projections (and LM head) on CPU.

- "xla": XLA's own ops (jaxinfer.layers.linear): W @ x^T between materialized transposes, and
  for int8 weights a convert fused into the dot (or a multiply and a sum for one row).
- "cpu": the C++ kernel of cpu_kernels.matmul through the XLA FFI (AVX2 + FMA), on float32
  or int8 weights: token-major in and out, so no transposes, and int8 read as int8. Needs
  XLA:CPU, float32 activations, the "out_in" layout, one device (XLA cannot split a custom
  call over a mesh) and a C++ compiler to build it once.
- "auto": "cpu" for int8 weights wherever it can run, else "xla". For float32 weights the
  kernel measured no faster than XLA (per decode step of the default model's layers: 20.8
  against 22.0 ms at 1 row, 82 against 67 ms at 32 rows), while for int8 it is what makes
  them pay: 10.3 ms at 1 row and 53.5 ms at 32 (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError
from cpu_kernels.matmul.kernel import load_matmul
from jaxinfer.layers.linear import OUT_IN

IMPLS = ("auto", "xla", "cpu")

logger = logging.getLogger(__name__)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"matmul_impl must be one of {IMPLS}, got {impl!r}")


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
    """The kernel for ModelKernels.matmul, or None for XLA's ops. "cpu" where it cannot run
    is a ValueError naming why (or KernelBuildError when it cannot be built)."""
    check_impl(impl)
    if impl == "xla" or (impl == "auto" and quantization != "int8"):
        return None
    reasons = []
    if platform != "cpu":
        reasons.append(f"it runs on XLA:CPU, not {platform}")
    if tensor_parallel_size != 1:
        reasons.append("it runs on one device (tensor_parallel_size=1)")
    if weight_layout != OUT_IN:
        reasons.append("it takes the 'out_in' weight layout")
    if jnp.dtype(dtype) != jnp.float32:
        reasons.append(f"it takes float32 activations, not {jnp.dtype(dtype).name}")
    if reasons:
        if impl == "cpu":
            raise ValueError("matmul_impl 'cpu' cannot run here: " + "; ".join(reasons))
        return None
    try:
        return load_matmul(build_dir)
    except KernelBuildError as error:
        if impl == "cpu":
            raise
        logger.warning("CPU matmul kernel unavailable (%s); projections run on XLA", error)
        return None
