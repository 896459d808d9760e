"""KernelMatmul: the C++ matmul kernels for XLA:CPU (cpu_kernels.matmul, cpu_kernels.gguf_matmul)
standing in for XLA's "out_in" products (jaxinfer.layers.linear), each where it is faster.
Where they are used at all is decided in jaxinfer.config.resolve.

- The float32 and int8 kernel: token-major in and out (no transposes), int8 read as int8.
  Float32 products of more than KERNEL_MAX_FLOAT_ROWS rows (prefill chunks) stay on XLA's
  blocked GEMM, which is as fast or faster there (tools/bench_cpu_matmul.py); int8 ones always
  take the kernel (XLA has no fast int8 path).
- The GGUF block kernel: a weight kept in its GGUF file's blocks
  (jaxinfer.layers.weights.GGUFWeight) is multiplied from them for every row count, exactly
  or with activations rounded to int8 (int8_activations, llama.cpp's way); a MoE layer's
  experts by its grouped product.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from cpu_kernels.gguf_matmul.kernel import gguf_grouped_matmul
from cpu_kernels.matmul.kernel import grouped_int4_matmul, grouped_matmul, int4_matmul
from jaxinfer.layers.linear import OUT_IN, StackedWeight, unstacked, xla_dense

# Rows of x up to which float32 products take the kernel (a step bucket; XLA above), where
# tools/bench_cpu_matmul.py found the kernel ahead.
KERNEL_MAX_FLOAT_ROWS = 48


@dataclasses.dataclass(frozen=True)
class KernelMatmul:
    """ModelKernels.matmul: `kernel` (cpu_kernels.matmul) for int8 weights and for float32 ones
    of up to `max_float_rows` rows of x, XLA's "out_in" product for longer float32 ones; and
    `gguf_kernel` (cpu_kernels.gguf_matmul) for weights kept in GGUF blocks. Weights are
    "out_in" arrays, or StackedWeights (read in place)."""

    kernel: Callable
    max_float_rows: int = KERNEL_MAX_FLOAT_ROWS
    gguf_kernel: Callable | None = None
    # Batch-invariant mode: every product through `kernel` in its fixed order, whatever the
    # number of rows (no XLA GEMM for long chunks; resolve leaves out the GGUF blocks).
    fixed_order: bool = False
    # The experts' grouped products, every row count (XLA has no grouped product but a dense
    # one over all experts): the same C++ library's, registered with `kernel`.
    grouped_kernel: Callable = grouped_matmul
    # int4 weights (steps of up to 4 rows) and GGUF block weights (every step): activations
    # rounded to int8 per block, integer dot products (EngineOptions.int8_activations).
    int8_activations: bool = False
    # i32[] under jit: the step's real tokens, the rows of x before its padding, which the
    # block kernel alone computes (for_tokens); None: every row.
    tokens: Any = None

    def for_tokens(self, count) -> KernelMatmul:
        return dataclasses.replace(self, tokens=count)

    def float32(self, x, w):  # x [T, in], w [*out, in] -> [T, *out]
        if x.shape[0] > self.max_float_rows and not self.fixed_order:
            return xla_dense(x, unstacked(w), OUT_IN)
        return self._kernel(x, w, None)

    def int8(self, x, q, scale):  # q i8[*out, in], scale f32[*out]
        return self._kernel(x, q, scale)

    def _kernel(self, x, w, scale):
        order = {"fixed_order": True} if self.fixed_order else {}
        if isinstance(w, StackedWeight):
            return self.kernel(x, w.stacked, scale, layer=w.layer, **order)
        return self.kernel(x, w, scale, **order)

    def int4(self, x, weight):
        """x [T, in] times an Int4 weight (jaxinfer.layers.weights) -> [T, N], every row count
        (XLA has no int4 product), through `kernel`'s library (its int4 entry point)."""
        arrays, kwargs = self._int4_arrays(weight)
        return int4_matmul(x, *arrays, **kwargs)

    def _int4_arrays(self, weight) -> tuple[tuple, dict]:
        """An Int4 weight's (qs, scale, bias), the whole stack with `layer` for a StackedWeight,
        and the kernel's mode arguments."""
        kwargs = {"int8_activations": self.int8_activations}
        if self.fixed_order:
            kwargs["fixed_order"] = True
        arrays = (weight.qs, weight.scale, weight.bias)
        if isinstance(weight.qs, StackedWeight):
            kwargs["layer"] = weight.qs.layer
            arrays = tuple(a.stacked for a in arrays)
        return arrays, kwargs

    def grouped(self, x, w, group_sizes, scale=None, x_rows=None, y_rows=None):
        """x [M, in] sorted by group (or [X, in] gathered by x_rows) times w [G, *out, in] (or
        its StackedWeight), with scale [G, *out] for int8 w -> [M, *out] (scattered by y_rows),
        through `grouped_kernel` (cpu_kernels.matmul.kernel.grouped_matmul)."""
        kwargs = {"x_rows": x_rows, "y_rows": y_rows}
        if self.fixed_order:
            kwargs["fixed_order"] = True
        if isinstance(w, StackedWeight):
            return self.grouped_kernel(x, w.stacked, group_sizes, scale, layer=w.layer, **kwargs)
        return self.grouped_kernel(x, w, group_sizes, scale, **kwargs)

    def grouped_int4(self, x, weight, group_sizes, x_rows=None, y_rows=None):
        """`grouped` for Int4 experts (weight: jaxinfer.layers.weights.Int4 over [G, ...])."""
        arrays, kwargs = self._int4_arrays(weight)
        return grouped_int4_matmul(x, *arrays, group_sizes, x_rows=x_rows, y_rows=y_rows, **kwargs)

    def blocks(self, x, weight):
        """x [T, in] times a GGUFWeight (jaxinfer.layers.weights) -> [T, N]."""
        data, table, layer = weight.stacked()
        n = math.prod(weight.out)
        return self.gguf_kernel(
            x, data, table, layer, n=n, int8_activations=self.int8_activations, valid=self.tokens
        )

    def grouped_blocks(self, x, weight, group_sizes, x_rows=None, y_rows=None):
        """`grouped` for experts kept in GGUF blocks (a GGUFWeight of `groups` experts per
        layer) -> [M, *out], through the block kernel's grouped product."""
        data, table, layer = weight.stacked()
        y = gguf_grouped_matmul(
            x,
            data,
            table,
            layer,
            group_sizes,
            n=math.prod(weight.out),
            x_rows=x_rows,
            y_rows=y_rows,
            int8_activations=self.int8_activations,
        )
        return y.reshape(y.shape[0], *weight.out)
