"""The one place that chooses how Pallas kernels lower on NVIDIA GPUs.

Two GPU backends exist in JAX: Triton (deprecated in JAX 0.11 but still shipped; it lowers
the portable subset of Pallas the kernels here use: whole-array refs read with `pl.ds` tiles
and block-table gathers, `jnp.dot`, loops) and Mosaic GPU (Hopper's wgmma and TMA, but a
different, warpgroup-level programming model that has no interpreter on CPU). The kernels here
are written once against the portable subset; this module picks Triton while the installed JAX
ships it, and says plainly what to do when it does not. Nothing outside this module imports a
backend-specific Pallas module.

Every kernel takes `interpret=True` to run on CPU through Pallas' interpreter (the tests), and
`lower_for_gpu` lowers a function for CUDA on a machine without a GPU, so CI catches kernels
that would not lower.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import pallas as pl

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Per-kernel launch parameters (Triton: warps per program, software-pipelining depth)."""

    num_warps: int = 4
    num_stages: int = 2


@functools.cache
def gpu_backend() -> str:
    """ "triton" when the installed JAX ships the Pallas Triton backend, else "none"."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return "none"
    return "triton"


def compiler_params(launch: LaunchConfig) -> Any:
    if gpu_backend() != "triton":
        raise NotImplementedError(
            f"JAX {jax.__version__} has no Pallas Triton backend; the kernels in pallas_kernels "
            "are not ported to Mosaic GPU yet: use the reference implementations "
            "(attention_impl='reference', ffn_impl='reference')"
        )
    triton = importlib.import_module("jax.experimental.pallas.triton")
    return triton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)


def call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    launch: LaunchConfig,
    interpret: bool,
    name: str,
) -> Callable[..., Any]:
    """pallas_call with whole-array refs (the kernels index their own tiles)."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        interpret=interpret,
        name=name,
        compiler_params=None if interpret else compiler_params(launch),
    )


def lower_for_gpu(fn: Callable[..., Any], *args: Any) -> str:
    """The StableHLO text of `fn(*args)` lowered for CUDA (no GPU needed): raises if a kernel
    does not lower through the chosen backend."""
    exported = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
    )(*args)
    return exported.mlir_module()
