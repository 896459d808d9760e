"""Whether a C++ kernel for XLA:CPU (cpu_kernels) can run with the settings asked for, and
loading it: jaxinfer.config.resolve's questions about the native kernels."""

from __future__ import annotations

import logging

from cpu_kernels.build import KernelBuildError
from cpu_kernels.gguf_matmul.kernel import has_avx512_vnni
from jaxinfer.config.platform import Platform

logger = logging.getLogger(__name__)


def native_reasons(platform: Platform, tp: int, dtype: str) -> list[str]:
    """Why no C++ kernel can run with these settings (empty when they can)."""
    reasons = []
    if platform.backend != "cpu":
        reasons.append(f"it runs on XLA:CPU, not {platform.backend}")
    if tp != 1:
        reasons.append("it runs on one device (tensor_parallel_size=1)")
    if dtype != "float32":
        reasons.append(f"it takes float32 activations, not {dtype}")
    unavailable = platform.native_unavailable()
    if unavailable is not None:
        reasons.append(unavailable)
    return reasons


def native_kernel(platform: Platform, name: str, option: str, value: str, reasons: list[str]):
    """(the C++ kernel `name`, why not): where `value` was asked for explicitly ("cpu"/"on"),
    a reason is a ValueError and a failed build a KernelBuildError."""
    required = value != "auto"
    if reasons:
        if required:
            raise ValueError(f"{option} {value!r} cannot be used here: " + "; ".join(reasons))
        return None, "; ".join(reasons)
    try:
        return platform.load_native(name), ""
    except KernelBuildError as error:
        if required:
            raise
        logger.warning("C++ kernel for %s unavailable (%s); going without it", option, error)
        return None, f"its build failed ({error})"


def check_int8_activations(options, matmul_fn, gguf_fn, int4: bool) -> None:
    """int8_activations needs the C++ kernel and weights it applies to (int4 or GGUF blocks)."""
    if options.int8_activations and (matmul_fn is None or (not int4 and gguf_fn is None)):
        why = "the kernel is not in use" if matmul_fn is None else "the model has neither"
        raise ValueError(f"int8_activations applies to int4 and GGUF block weights: {why}")


def gguf_interleaved(options, gguf_fn) -> bool:
    """Whether the GGUF file's block weights (every format but Q5_1 and Q5_K) are laid out
    interleaved at load (16 rows at a time, cpu_kernels/gguf_matmul/interleaved.h): where the
    block kernel takes int8 activations on AVX-512 VNNI, the one path that reads that layout
    at full speed."""
    return gguf_fn is not None and options.int8_activations and has_avx512_vnni()
