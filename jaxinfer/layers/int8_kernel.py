"""Which implementation computes the int8 projections of quantization="int8".

- "xla": XLA's own ops (jaxinfer.layers.linear): a convert fused into a dot, or a multiply and
  a sum for one row. Runs everywhere; on this CPU no faster than the float32 weights.
- "cpu": the C++ kernel of cpu_kernels.int8_matmul through the XLA FFI (AVX2 + FMA): reads
  each weight once as int8. Needs XLA:CPU, float32 activations, the "out_in" layout, one
  device (XLA cannot split a custom call over a mesh) and a C++ compiler to build it once.
- "auto": "cpu" wherever it can run, else "xla".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError
from cpu_kernels.int8_matmul.kernel import load_int8_matmul
from jaxinfer.layers.linear import OUT_IN

IMPLS = ("auto", "xla", "cpu")

logger = logging.getLogger(__name__)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"int8_matmul_impl must be one of {IMPLS}, got {impl!r}")


def select_int8_matmul(
    impl: str,
    *,
    quantization: str | None,
    platform: str,
    tensor_parallel_size: int,
    weight_layout: str,
    dtype,
    build_dir: Path,
) -> Callable | None:
    """The kernel for ModelKernels.int8_matmul, or None for XLA's ops. "cpu" where it cannot
    run is a ValueError naming why (or KernelBuildError when it cannot be built)."""
    check_impl(impl)
    if impl == "xla" or quantization != "int8":
        if impl == "cpu":
            raise ValueError("int8_matmul_impl 'cpu' computes quantization='int8' weights only")
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
            raise ValueError("int8_matmul_impl 'cpu' cannot run here: " + "; ".join(reasons))
        return None
    try:
        return load_int8_matmul(build_dir)
    except KernelBuildError as error:
        if impl == "cpu":
            raise
        logger.warning("int8 CPU kernel unavailable (%s); int8 projections run on XLA", error)
        return None
