"""Engine options from a TOML file under configs/ (read at the entry points only)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from jaxinfer.config import EngineOptions


def load_engine_options(path: str | Path | None, **overrides: Any) -> EngineOptions:
    """EngineOptions from the file's [engine] table, with non-None overrides (flags) on top."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            document = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML ({e})") from None
        unknown_tables = set(document) - {"engine"}
        if unknown_tables:
            raise ValueError(f"{path}: unknown tables {sorted(unknown_tables)} (expected [engine])")
        values = dict(document.get("engine", {}))
        known = {f.name for f in dataclasses.fields(EngineOptions)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(
                f"{path}: unknown engine options {sorted(unknown)}; known: {sorted(known)}"
            )
    values.update({k: v for k, v in overrides.items() if v is not None})
    return EngineOptions(**values)
