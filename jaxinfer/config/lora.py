"""LoRA's kernel settled (for jaxinfer.config.resolve): the C++ kernel on XLA:CPU where it
runs, the Pallas kernel on one GPU, else the pure-JAX reference; under batch_invariant only
kernels that compute each row on its own (the C++ and Pallas ones)."""

from __future__ import annotations

from collections.abc import Callable

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.native import native_kernel, native_reasons
from jaxinfer.config.options import EngineOptions
from jaxinfer.config.platform import Platform
from jaxinfer.layers.kernel_registry import KernelRegistry
from jaxinfer.layers.lora import target_shapes


def lora_kernel(
    options: EngineOptions,
    platform: Platform,
    arch: LlamaConfig,
    dtype: str,
    registry: KernelRegistry,
    reasons: dict[str, str],
) -> tuple[str | None, Callable | None]:
    """(the kernel's name, the callable), or (None, None) without enable_lora."""
    name, tp = options.lora_impl, options.tensor_parallel_size
    if not options.enable_lora:
        if name != "auto":
            raise ValueError("lora_impl is only used with enable_lora")
        return None, None
    if platform.num_processes > 1:
        raise ValueError("enable_lora cannot be used with several processes yet")
    cpu = platform.backend == "cpu"
    if name in ("auto", "cpu"):
        why = native_reasons(platform, tp, dtype)
        asked = "cpu" if options.batch_invariant and cpu else name
        fn, why_not = native_kernel(platform, "lora", "lora_impl", asked, why)
        if fn is not None:
            if name == "auto":
                reasons["lora"] = "the C++ kernel runs here"
            return "cpu", fn
        if name == "auto":
            single_gpu = platform.backend == "gpu" and tp == 1
            untiled = _untiled(arch)
            name = "pallas" if single_gpu and not untiled else "reference"
            reasons["lora"] = (
                "the Pallas kernel on one GPU"
                if name == "pallas"
                else f"the reference: the Pallas kernel {untiled}"
                if single_gpu
                else why_not
            )
    if options.batch_invariant and name == "reference":
        raise ValueError(
            "batch_invariant: the reference LoRA product runs every row through every slot in "
            "one XLA dot; use the C++ (CPU) or Pallas (GPU) kernel"
        )
    if name == "pallas" and (cpu or tp > 1):
        raise ValueError("lora_impl 'pallas' runs on one GPU (pallas_interpret runs it on CPU)")
    if name in ("pallas", "pallas_interpret") and _untiled(arch):
        raise ValueError(f"lora_impl {name!r}: the kernel {_untiled(arch)}")
    return name, registry.get("lora", name)


def _untiled(arch: LlamaConfig) -> str:
    """Why the Pallas kernel cannot tile this model's projections ("" where it can)."""
    odd = [t for t, sizes in target_shapes(arch).items() if any(n % 16 for n in sizes)]
    return f"tiles inputs and outputs by 16, which {', '.join(odd)} are not" if odd else ""
