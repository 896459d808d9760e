"""Command-line flags and TOML keys generated from EngineOptions' fields, for every entry point
(the server, the batch runner, the demo, the tools).

A flag left unset keeps the value of the --config TOML file's [engine] table, or else the
option's default. `parse_overrides` reads "key=value,..." (tools' --compare) with the same
types.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from absl import flags

from jaxinfer.config.options import EngineOptions
from jaxinfer.parallel.distributed import DistributedConfig

_DEFINE = {
    str: flags.DEFINE_string,
    int: flags.DEFINE_integer,
    float: flags.DEFINE_float,
    bool: flags.DEFINE_bool,
    tuple: flags.DEFINE_list,  # comma-separated; EngineOptions reads the items' numbers
}


def option_type(field: dataclasses.Field) -> type:
    """The option's value type: str, int, float, bool or tuple (an Optional's inner type)."""
    hint = typing.get_type_hints(EngineOptions)[field.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.get_origin(hint) or hint


def _help(field: dataclasses.Field) -> str:
    text = field.metadata["help"]
    choices = field.metadata["choices"]
    if choices is not None:
        text += f" One of: {', '.join(map(str, choices))}."
    default = "unset" if field.default is None else repr(field.default)
    return f"{text} (default: {default})"


def define_engine_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """One flag per EngineOptions field, plus --config and the jax.distributed flags."""
    flags.DEFINE_string(
        "config",
        None,
        "TOML file of engine options ([engine] table); flags win.",
        flag_values=flag_values,
    )
    for field in dataclasses.fields(EngineOptions):
        _DEFINE[option_type(field)](field.name, None, _help(field), flag_values=flag_values)
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "jax.distributed: process 0's host:port.",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "num_processes", None, "jax.distributed: processes in the job.", flag_values=flag_values
    )
    flags.DEFINE_integer(
        "process_id", None, "jax.distributed: this process's index.", flag_values=flag_values
    )
    flags.DEFINE_string(
        "control_host",
        None,
        "Several processes: the address process 0's control channel binds to and the others "
        "connect to (default: the coordinator's host, on the interface it routes over).",
        flag_values=flag_values,
    )


def engine_options_from_flags(
    flag_values: flags.FlagValues = flags.FLAGS,
    defaults: dict[str, Any] | None = None,
    **overrides: Any,
) -> EngineOptions:
    """The options the flags (over the --config file) say; `overrides` win over both, and
    `defaults` (an entry point's own) stand where neither sets an option."""
    values = {f.name: flag_values[f.name].value for f in dataclasses.fields(EngineOptions)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return load_engine_options(flag_values.config, defaults, **values)


def distributed_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> DistributedConfig:
    return DistributedConfig(
        coordinator_address=flag_values.coordinator_address,
        num_processes=flag_values.num_processes,
        process_id=flag_values.process_id,
        control_host=flag_values.control_host,
    )


def load_engine_options(
    path: str | Path | None, defaults: dict[str, Any] | None = None, **overrides: Any
) -> EngineOptions:
    """EngineOptions from a TOML file's [engine] table over `defaults`, with non-None
    overrides on top."""
    values: dict[str, Any] = dict(defaults or {})
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
        table = dict(document.get("engine", {}))
        known = {f.name for f in dataclasses.fields(EngineOptions)}
        unknown = set(table) - known
        if unknown:
            raise ValueError(
                f"{path}: unknown engine options {sorted(unknown)}; known: {sorted(known)}"
            )
        values.update(table)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return EngineOptions(**values)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["key=value", ...] -> {option: typed value}; "none" unsets an optional option, and a
    list option's items are separated by ":" (token_buckets=4:16)."""
    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"expected KEY=VALUE with KEY an engine option, got {item!r}")
        kind = option_type(fields[key])
        if text.lower() in ("none", "null") and fields[key].default is None:
            out[key] = None
        elif kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key} takes true or false, got {text!r}")
            out[key] = text.lower() in ("true", "1")
        elif kind is tuple:
            out[key] = tuple(text.split(":"))  # EngineOptions checks and converts the items
        else:
            try:
                out[key] = kind(text)
            except ValueError:
                raise ValueError(f"{key} takes a {kind.__name__}, got {text!r}") from None
    return out
