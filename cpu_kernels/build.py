"""Compiles a kernel's C++ source into a shared library once, and loads it.

The library is named by a hash of the source, the shared headers, the compiler command, the
compiler's own version and the jaxlib version, so a changed kernel, compiler or jaxlib builds
anew and an unchanged one is loaded from `build_dir`. Concurrent builds write to a temporary
file and rename it into place.

The kernels use AVX2 and FMA: on a CPU without them (checked at run time, before anything is
built or loaded) building is a KernelBuildError, so "auto" options fall back to XLA instead of
dying on an illegal instruction.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

HEADERS = Path(__file__).parent  # common.h, shared by the kernels
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC")
# What -mavx2 -mfma -mf16c let the compiler emit (every AVX2 CPU has F16C).
REQUIRED_CPU_FEATURES = ("avx2", "fma", "f16c")


class KernelBuildError(RuntimeError):
    """The host cannot build or run a C++ kernel (no compiler, or a failed compile)."""


def compiler() -> str | None:
    """The C++ compiler on PATH, if any."""
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (/proc/cpuinfo); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def check_cpu() -> None:
    """KernelBuildError unless this CPU runs what the kernels are compiled to."""
    missing = [f for f in REQUIRED_CPU_FEATURES if f not in cpu_features()]
    if missing:
        raise KernelBuildError(
            f"the C++ kernels need a CPU with {', '.join(REQUIRED_CPU_FEATURES).upper()}; this "
            f"one lacks {', '.join(missing).upper()} (or does not report its features)"
        )


def can_build() -> bool:
    """Whether the kernels can be built and run here (a compiler, and the CPU features)."""
    try:
        check_cpu()
    except KernelBuildError:
        return False
    return compiler() is not None


@functools.cache
def compiler_version(cxx: str) -> str:
    """The compiler's own description of itself (`--version`), part of a build's name."""
    result = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return result.stdout + result.stderr


def build(source: Path, build_dir: Path) -> Path:
    """The shared library of `source`, compiled into `build_dir` unless already there."""
    check_cpu()
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++, c++ or clang++) on PATH")
    command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HEADERS}"]
    digest = hashlib.sha256(" ".join(command).encode() + jaxlib.__version__.encode())
    digest.update(compiler_version(cxx).encode())
    # The source, the shared headers and its own (a kernel's parts included beside it).
    for path in [source, *sorted(HEADERS.glob("*.h")), *sorted(source.parent.glob("*.h"))]:
        digest.update(path.read_bytes())
    key = digest.hexdigest()[:16]
    target = Path(build_dir) / f"{source.parent.name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [*command, str(source), "-o", partial], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {source.name} failed:\n{result.stderr[-4000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


@functools.cache
def load(library: Path) -> ctypes.CDLL:
    """The loaded library (once per process)."""
    return ctypes.cdll.LoadLibrary(str(library))


# XLA keeps one handler per custom-call name for the whole process: which library (by file
# name, that is by source hash) registered each name.
_registered: dict[str, str] = {}


def register(library: Path, symbol: str, target_name: str) -> None:
    """Registers the FFI handler `symbol` of `library` as XLA:CPU custom call `target_name`,
    once per process. The same build from another folder reuses the registration; another
    build of the kernel in the same process is an error (XLA cannot replace a handler)."""
    key = Path(library).name
    if target_name in _registered:
        if _registered[target_name] != key:
            raise KernelBuildError(
                f"{target_name} is already registered from {_registered[target_name]} in this "
                f"process; cannot register {key}"
            )
        return
    handler = getattr(load(library), symbol)
    jax.ffi.register_ffi_target(target_name, jax.ffi.pycapsule(handler), platform="cpu")
    _registered[target_name] = key
