"""The kernels of layers only some models have, settled for jaxinfer.config.resolve: a hybrid
model's delta rule (jaxinfer.config.gated_delta), DeepSeek-V4's attention
(jaxinfer.config.compressed)."""

from __future__ import annotations

from collections.abc import Callable

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.compressed import compressed_attention_kernel
from jaxinfer.config.gated_delta import gated_delta_kernel
from jaxinfer.config.options import EngineOptions
from jaxinfer.config.platform import Platform
from jaxinfer.layers.kernel_registry import KernelRegistry


def layer_kernels(
    options: EngineOptions,
    platform: Platform,
    arch: LlamaConfig,
    dtype: str,
    registry: KernelRegistry,
    reasons: dict[str, str],
) -> tuple[dict[str, str | None], dict[str, Callable]]:
    """(each kind's kernel name, None where the model has no such layers: ResolvedOptions'
    fields; the callables the model takes: ModelKernels' fields)."""
    delta, delta_fn = gated_delta_kernel(options, platform, arch, dtype, registry, reasons)
    compressed, compressed_fns = compressed_attention_kernel(
        options, platform, arch, dtype, registry, reasons
    )
    names = {"gated_delta": delta, "compressed_attention": compressed}
    fns = {} if delta_fn is None else {"gated_delta": delta_fn}
    return names, {**fns, **compressed_fns}
