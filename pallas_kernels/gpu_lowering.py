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
that would not lower. Since JAX 0.11 the Triton lowering reads the target GPU from the current
abstract mesh's device (and raises when neither it nor a real GPU is there), so the lowering
runs under an abstract H200, as JAX's own deviceless Pallas tests do; JAX 0.10 ignores it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# The device kind the deviceless lowering targets (the GPU this project is tuned on).
ABSTRACT_GPU = "NVIDIA H200"


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


def masked_store(ref: Any, value: jax.Array, mask: jax.Array) -> None:
    """Writes `value` into `ref` (a ref or a view, `ref.at[...]`) where `mask` holds, leaving
    the rest for other programs to write (the interpreter runs it too)."""
    if gpu_backend() != "triton":
        compiler_params(LaunchConfig())  # raises with the reason
    triton = importlib.import_module("jax.experimental.pallas.triton")
    triton.store(ref, value, mask=mask)


def lower_for_gpu(fn: Callable[..., Any], *args: Any, device_kind: str = ABSTRACT_GPU) -> str:
    """The StableHLO text of `fn(*args)` lowered for CUDA on `device_kind` (no GPU needed): raises
    if a kernel does not lower through the chosen backend. Only the shapes and dtypes of `args`
    are used."""
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), args)
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("gpu",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([^(\s]+)\(")


@functools.cache
def triton_custom_call() -> str:
    """The custom-call target JAX lowers a Pallas Triton kernel to (JAX names it; it has changed
    before), read from the lowering of a one-element kernel."""

    def copy(x_ref: Any, o_ref: Any) -> None:
        o_ref[...] = x_ref[...]

    kernel = call(
        copy,
        out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
        grid=(1,),
        launch=LaunchConfig(),
        interpret=False,
        name="custom_call_name",
    )
    names = set(_CUSTOM_CALL.findall(lower_for_gpu(kernel, jnp.zeros((16,), jnp.float32))))
    if len(names) != 1:
        raise RuntimeError(f"expected one custom call in a Pallas kernel's lowering, got {names}")
    return names.pop()


def custom_calls(text: str) -> list[str]:
    """The custom-call targets in a lowered module's text, in order."""
    return _CUSTOM_CALL.findall(text)
