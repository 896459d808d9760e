"""What the machine offers, as the one input besides EngineOptions that settles "auto"."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from cpu_kernels import build
from cpu_kernels.compressed_attention.kernel import load_compressed_attention
from cpu_kernels.gated_delta.kernel import load_gated_delta
from cpu_kernels.gguf_matmul.kernel import load_gguf_matmul
from cpu_kernels.lora.kernel import load_lora
from cpu_kernels.matmul.kernel import load_matmul
from cpu_kernels.paged_attention.kernel import load_paged_attention

# The C++ kernels for XLA:CPU by name: each loader builds its kernel once into a folder and
# returns it ready to call (compressed_attention: three of them, CompressedKernels), or
# raises cpu_kernels.build.KernelBuildError.
NATIVE_LOADERS: dict[str, Callable[[Path], Any]] = {
    "matmul": load_matmul,
    "gguf_matmul": load_gguf_matmul,
    "paged_attention": load_paged_attention,
    "lora": load_lora,
    "gated_delta": load_gated_delta,
    "compressed_attention": load_compressed_attention,
}


@dataclasses.dataclass(frozen=True)
class Platform:
    backend: str  # jax.default_backend(): "cpu", "gpu", "tpu"
    num_devices: int  # in the whole job (every process)
    cpu_features: frozenset[str]  # as /proc/cpuinfo reports them
    compiler: str | None  # the C++ compiler on PATH, for the C++ kernels
    native_dir: Path  # where the C++ kernels are built
    num_processes: int = 1  # jax.distributed processes in the job

    @classmethod
    def detect(cls, cache_dir: str | Path) -> Platform:
        return cls(
            backend=jax.default_backend(),
            num_devices=jax.device_count(),
            cpu_features=build.cpu_features(),
            compiler=build.compiler(),
            native_dir=Path(cache_dir) / "cpu_kernels",
            num_processes=jax.process_count(),
        )

    def native_unavailable(self) -> str | None:
        """Why the C++ kernels cannot be built or run here, or None."""
        missing = [f for f in build.REQUIRED_CPU_FEATURES if f not in self.cpu_features]
        if missing:
            return f"the CPU lacks {', '.join(missing).upper()}"
        if self.compiler is None:
            return "no C++ compiler on PATH"
        return None

    def load_native(self, name: str) -> Any:
        """The C++ kernel `name` (NATIVE_LOADERS), built on first use; KernelBuildError."""
        return _load_native(name, self.native_dir)


@functools.cache
def _load_native(name: str, folder: Path) -> Any:
    return NATIVE_LOADERS[name](folder)
