"""PallasMatmul: the "out_in" projections and LM head through the Pallas matmul kernel
(pallas_kernels/matmul), whose tiles do not depend on the number of rows: the batch-invariant
mode's products on a GPU, where XLA's dot (cuBLAS) picks its tiling and split-K from the whole
shape. It stands where ModelKernels.matmul holds the C++ kernels on CPU (KernelMatmul), for
float weights only: jaxinfer.config.resolve refuses the formats it has no product for.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxinfer.layers.linear import StackedWeight
from pallas_kernels.matmul.kernel import OUT_IN, matmul


@dataclasses.dataclass(frozen=True)
class PallasMatmul:
    """ModelKernels.matmul on a GPU under batch_invariant; `interpret` runs the kernel through
    Pallas' interpreter (the CPU tests)."""

    interpret: bool = False
    int8_activations: bool = False  # (no integer path: the attribute KernelMatmul has)

    @property
    def name(self) -> str:  # ResolvedOptions.matmul
        return "pallas_interpret" if self.interpret else "pallas"

    def float32(self, x, w) -> jax.Array:  # x [T, in], w [*out, in] -> [T, *out]
        """Named after KernelMatmul's float path; takes the model's float dtype."""
        layer = None
        if isinstance(w, StackedWeight):
            w, layer = w.stacked, w.layer
            out = w.shape[1:-1]
            w = w.reshape(w.shape[0], math.prod(out), w.shape[-1])
        else:
            out = w.shape[:-1]
            w = w.reshape(math.prod(out), w.shape[-1])
        y = matmul(x, w, layout=OUT_IN, layer=layer, interpret=self.interpret)
        return y.reshape(x.shape[0], *out)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "the Pallas matmul kernel takes float weights only (resolve refuses the rest)"
        )

    int8 = int4 = grouped = grouped_int4 = blocks = _unsupported
