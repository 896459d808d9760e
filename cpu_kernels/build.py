"""Compiles a kernel's C++ source into a shared library once, and loads it.

The library is named by a hash of the source, the shared headers, the compiler command and the
jaxlib version, so a changed kernel or a new jaxlib builds anew and an unchanged one is loaded
from `build_dir`.
Concurrent builds write to a temporary file and rename it into place.
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
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    """The host cannot build or run a C++ kernel (no compiler, or a failed compile)."""


def compiler() -> str | None:
    """The C++ compiler on PATH, if any."""
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(source: Path, build_dir: Path) -> Path:
    """The shared library of `source`, compiled into `build_dir` unless already there."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++, c++ or clang++) on PATH")
    command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HEADERS}"]
    digest = hashlib.sha256(" ".join(command).encode() + jaxlib.__version__.encode())
    for path in [source, *sorted(HEADERS.glob("*.h"))]:
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
