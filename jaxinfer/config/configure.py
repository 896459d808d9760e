"""EngineOptions and a model folder -> the engine's frozen config and the kernels it runs."""

from __future__ import annotations

from pathlib import Path

from jaxinfer.config.engine_config import EngineConfig, build_engine_config, model_arch
from jaxinfer.config.options import EngineOptions
from jaxinfer.config.platform import Platform
from jaxinfer.config.resolve import resolve
from jaxinfer.layers.kernel_registry import KernelRegistry, ModelKernels, default_registry


def configure(
    options: EngineOptions,
    folder: Path,
    registry: KernelRegistry | None = None,
    gguf_source: Path | None = None,
    platform: Platform | None = None,
    draft_folder: Path | None = None,
) -> tuple[EngineConfig, ModelKernels]:
    """Resolves `options` on this platform (jaxinfer.config.resolve) for the model in
    `folder`; `registry`: where kernel names are looked up (default: the built-in ones);
    `draft_folder`: the draft model's (its KV cache shares the memory budget)."""
    resolution = resolve(
        options,
        platform or Platform.detect(options.cache_dir),
        model_arch(options, folder),
        registry if registry is not None else default_registry(),
        gguf_source,
    )
    config = build_engine_config(options, resolution.options, folder, draft_folder)
    return config, resolution.kernels
