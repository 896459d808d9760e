"""A hybrid model's delta-rule kernel settled (for jaxinfer.config.resolve): the C++ kernel on
XLA:CPU where it runs, the Pallas kernel on a GPU, else the pure-JAX reference. Under
batch_invariant the reference is refused: it takes another form for a decode step than for a
prefill step, and XLA fuses its one-token scan into the ops after it, so a row's arithmetic
would depend on the step's shape. The C++ and Pallas kernels take their recurrent forms for
every token there (chunk 0: a chunked form's arithmetic depends on where a prompt splits
into steps; the recurrent one walks each request's tokens one by one whatever the batch)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.native import native_kernel, native_reasons
from jaxinfer.config.options import EngineOptions
from jaxinfer.config.platform import Platform
from jaxinfer.layers.kernel_registry import KernelRegistry


def gated_delta_kernel(
    options: EngineOptions,
    platform: Platform,
    arch: LlamaConfig,
    dtype: str,
    registry: KernelRegistry,
    reasons: dict[str, str],
) -> tuple[str | None, Callable | None]:
    """(the kernel's name, the callable), or (None, None) for a model without linear
    layers."""
    name = options.gated_delta_impl
    if arch.hybrid is None:
        if name != "auto":
            raise ValueError("gated_delta_impl applies to hybrid models (linear-attention layers)")
        return None, None
    cpu = platform.backend == "cpu"
    if name in ("auto", "cpu"):
        why = native_reasons(platform, options.tensor_parallel_size, dtype)
        fn, why_not = native_kernel(platform, "gated_delta", "gated_delta_impl", name, why)
        if fn is not None:
            if name == "auto":
                reasons["gated_delta"] = "the C++ kernel runs here"
            return "cpu", _recurrent_if_invariant(fn, options)
        if name == "auto":
            name = "reference" if cpu else "pallas"
            reasons["gated_delta"] = (
                f"the reference: not the C++ kernel: {why_not}" if cpu else "the Pallas kernel"
            )
    if options.batch_invariant and name == "reference":
        raise ValueError(
            "batch_invariant: the reference delta rule's arithmetic depends on the step's "
            "shape; use the C++ (CPU) or Pallas (GPU) kernel"
        )
    if name == "pallas" and cpu:
        raise ValueError("gated_delta_impl 'pallas' runs on a GPU (pallas_interpret on CPU)")
    fn = registry.get("gated_delta", name)
    if name in ("pallas", "pallas_interpret"):
        fn = _recurrent_if_invariant(fn, options)
    return name, fn


def _recurrent_if_invariant(fn: Callable, options: EngineOptions) -> Callable:
    """The built-in kernels' recurrent form for every step under batch_invariant."""
    return functools.partial(fn, chunk=0) if options.batch_invariant else fn
