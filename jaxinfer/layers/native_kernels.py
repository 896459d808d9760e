"""Where the C++ kernels for XLA:CPU (cpu_kernels, through the XLA FFI) replace XLA's ops.

Both need XLA:CPU, float32 activations and one device (XLA cannot split a custom call over a
mesh), and a C++ compiler to build them once into `<cache_dir>/cpu_kernels`.

matmul_impl, for the "out_in" projections and LM head (cpu_kernels.matmul):
- "xla": XLA's own ops (jaxinfer.layers.linear): W @ x^T between materialized transposes, and
  for int8 weights a convert fused into the dot (or a multiply and a sum for one row).
- "cpu": the kernel: token-major in and out (no transposes), int8 read as int8. Float32
  products of more than KERNEL_MAX_FLOAT_ROWS rows (prefill chunks) stay on XLA's blocked
  GEMM, which is as fast or faster there; int8 ones always take the kernel (XLA has no fast
  int8 path). Needs the "out_in" layout.
- "auto": "cpu" wherever it can run, else "xla". Decode steps gained 10-20% in float32 (the
  32-row step 118 against 132-144 ms) and int8 is what makes it pay: 10.3 against 22.0 ms
  for the float32 layers at 1 row (docs/benchmarks.md).

gguf_weights, beside the matmul kernel (cpu_kernels.gguf_matmul, jaxinfer.layers.gguf_weights):
where the model folder holds the GGUF file its float32 weights were dequantized from, its
Q4_1 and Q8_0 blocks are kept too (once checked to dequantize to the same bits), and products
of up to KERNEL_MAX_BLOCK_ROWS rows read them instead: bit-identical results from a quarter of
the bytes, for the decode steps of one to three requests, which are bound by reading weights.

attention_impl "cpu" (cpu_kernels.paged_attention): ragged paged attention walking each
request's blocks with an online softmax, 3-5x faster than the reference on every shape
measured. "auto" picks it on CPU wherever it runs (head_dim a multiple of 8 up to 256,
block_size up to 128), else the registry's choice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

from cpu_kernels.build import KernelBuildError
from cpu_kernels.gguf_matmul.kernel import load_gguf_matmul
from cpu_kernels.matmul.kernel import load_matmul
from cpu_kernels.paged_attention.kernel import load_paged_attention
from jaxinfer.layers.gguf_weights import block_format
from jaxinfer.layers.linear import OUT_IN, StackedWeight, dense, unstacked

IMPLS = ("auto", "xla", "cpu")
GGUF_MODES = ("auto", "on", "off")
# Rows of x up to which float32 products take the kernel (a step bucket; XLA above).
# tools/bench_cpu_matmul.py: at 64 rows the two were even on gate_up and qkv and XLA 1.2x
# faster on down; at 128-512 rows XLA was 1.0-2x faster; at 8-32 rows the kernel 1.3-2x.
KERNEL_MAX_FLOAT_ROWS = 48
# Rows of x up to which products take a weight's GGUF blocks, where it has them: the rows the
# block kernel sums exactly as the float32 kernel (its one-to-three-row path) does.
KERNEL_MAX_BLOCK_ROWS = 3

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


def _load(
    name: str, value: str, required: bool, reasons: list[str], loader: Callable, build_dir: Path
):
    """The kernel from `loader`, or None where it cannot be had and is not `required`; where it
    is (option `name` set to `value`), a ValueError naming why it cannot run, or the
    KernelBuildError when it cannot be built."""
    if reasons:
        if required:
            raise ValueError(f"{name} {value!r} cannot be used here: " + "; ".join(reasons))
        return None
    try:
        return loader(build_dir)
    except KernelBuildError as error:
        if required:
            raise
        logger.warning("C++ kernel for %s unavailable (%s); going without it", name, error)
        return None


@dataclasses.dataclass(frozen=True)
class KernelMatmul:
    """ModelKernels.matmul: `kernel` for int8 weights and for float32 ones of up to
    `max_float_rows` rows of x, XLA's "out_in" product for longer float32 ones; and
    `gguf_kernel` (cpu_kernels.gguf_matmul) for up to `max_block_rows` rows of x where the
    weight has GGUF blocks: the same products, bit for bit, from a quarter of the bytes."""

    kernel: Callable
    max_float_rows: int = KERNEL_MAX_FLOAT_ROWS
    gguf_kernel: Callable | None = None
    max_block_rows: int = KERNEL_MAX_BLOCK_ROWS

    def __call__(self, x, w, scale=None, blocks=None):
        """w: an array, or a StackedWeight (read in place); blocks: (qs, scales) or None,
        each an array or a StackedWeight."""
        if blocks is not None and self.gguf_kernel and x.shape[0] <= self.max_block_rows:
            return self._blocks(x, w, *blocks)
        stacked = isinstance(w, StackedWeight)
        weight = w.stacked if stacked else w
        if weight.dtype != jnp.int8 and x.shape[0] > self.max_float_rows:
            return dense(x, unstacked(w), OUT_IN, scale)
        if stacked:
            return self.kernel(x, w.stacked, scale, layer=w.layer)
        return self.kernel(x, w, scale)

    def _blocks(self, x, w, qs, scales):
        fmt = block_format(qs.stacked if isinstance(qs, StackedWeight) else qs)
        out = w.stacked.shape[1:-1] if isinstance(w, StackedWeight) else w.shape[:-1]
        if isinstance(qs, StackedWeight):
            y = self.gguf_kernel(fmt, x, qs.stacked, scales.stacked, layer=qs.layer)
        else:
            y = self.gguf_kernel(fmt, x, qs, scales)
        return y.reshape(x.shape[0], *out)  # [T, *out]


def select_matmul(
    impl: str,
    *,
    platform: str,
    tensor_parallel_size: int,
    weight_layout: str,
    dtype,
    build_dir: Path,
) -> Callable | None:
    """The kernel for ModelKernels.matmul, or None for XLA's ops."""
    check_impl(impl)
    if impl == "xla":
        return None
    reasons = _common_reasons(platform, tensor_parallel_size, dtype)
    if weight_layout != OUT_IN:
        reasons.append("it takes the 'out_in' weight layout")
    kernel = _load("matmul_impl", impl, impl == "cpu", reasons, load_matmul, build_dir)
    return None if kernel is None else KernelMatmul(kernel)


def select_gguf_kernel(
    mode: str, matmul: Callable | None, quantization: str | None, build_dir: Path
) -> Callable | None:
    """KernelMatmul.gguf_kernel for gguf_weights `mode`, or None. It works beside the matmul
    kernel (float32 weights, "out_in", one CPU device): "on" where it cannot is a ValueError
    naming why; "auto" then goes without."""
    check_gguf_mode(mode)
    if mode == "off":
        return None
    reasons = []
    if not isinstance(matmul, KernelMatmul):
        reasons.append("it works beside the matmul kernel, which is not in use (matmul_impl)")
    if quantization is not None:
        reasons.append(f"it takes float32 weights, not {quantization}")
    return _load("gguf_weights", mode, mode == "on", reasons, load_gguf_matmul, build_dir)


def check_gguf_mode(mode: str) -> None:
    if mode not in GGUF_MODES:
        raise ValueError(f"gguf_weights must be one of {GGUF_MODES}, got {mode!r}")


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
    kernel = _load("attention_impl", impl, impl == "cpu", reasons, load_paged_attention, build_dir)
    return resolved if kernel is None else kernel
