"""Engine options from TOML files and command-line flags, both generated from EngineOptions."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from jaxinfer.config import EngineOptions
from jaxinfer.config.flags import (
    define_engine_flags,
    engine_options_from_flags,
    load_engine_options,
    parse_overrides,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    load_engine_options(path)


def test_flags_override_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_seqs = 3\nblock_size = 32\n")
    options = load_engine_options(path, max_num_seqs=7, model=None)
    assert (options.max_num_seqs, options.block_size, options.model) == (7, 32, None)


def test_an_entry_points_defaults_lie_under_the_file_and_the_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nblock_size = 32\n")
    defaults = {"warmup": "auto", "block_size": 8, "max_num_seqs": 5}
    options = load_engine_options(path, defaults, max_num_seqs=7)
    assert (options.warmup, options.block_size, options.max_num_seqs) == ("auto", 32, 7)
    assert load_engine_options(None).warmup == "all"


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("[engine]\nmax_num_seq = 3\n", ValueError, "unknown engine options"),
        ("[server]\nport = 1\n", ValueError, "unknown tables"),
        ("[engine\n", ValueError, "invalid TOML"),
        ("[engine]\nblock_size = 7\n", ValueError, "block_size"),
    ],
)
def test_bad_files_are_clear_errors(tmp_path, text, error, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(error, match=message):
        load_engine_options(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_engine_options(tmp_path / "nope.toml")


def test_every_option_is_a_flag_of_the_server():
    """The flags are generated from EngineOptions' fields: each shows in --helpfull."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer.serve", "--helpfull"],
        capture_output=True,
        text=True,
        check=False,
    )
    for field in dataclasses.fields(EngineOptions):
        shown = (f"--{field.name}:", f"--[no]{field.name}:")
        assert any(flag in result.stdout for flag in shown), field.name


def test_generated_flags_override_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_seqs = 3\nquantization = 'int8'\n")
    values = flags.FlagValues()
    define_engine_flags(values)
    values(["prog", f"--config={path}", "--max_num_seqs=5", "--async_scheduling=false"])
    options = engine_options_from_flags(values)
    assert (options.max_num_seqs, options.quantization, options.async_scheduling) == (
        5,
        "int8",
        False,
    )
    assert options.block_size == EngineOptions().block_size


def test_overrides_are_parsed_with_the_options_types():
    parsed = parse_overrides(
        ["max_num_seqs=8", "async_scheduling=true", "quantization=none", "kv_cache_memory_gb=0.5"]
    )
    assert parsed == {
        "max_num_seqs": 8,
        "async_scheduling": True,
        "quantization": None,
        "kv_cache_memory_gb": 0.5,
    }
    for bad in ("max_num_seq=8", "max_num_seqs=eight", "async_scheduling=maybe", "dtype"):
        with pytest.raises(ValueError):
            parse_overrides([bad])


def test_token_buckets_from_a_flag_a_file_and_an_override(tmp_path):
    values = flags.FlagValues()
    define_engine_flags(values)
    values(["prog", "--token_buckets=16,4", "--max_num_batched_tokens=32"])
    assert engine_options_from_flags(values).token_buckets == (4, 16)
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_batched_tokens = 32\ntoken_buckets = [8, 2, 8]\n")
    assert load_engine_options(path).token_buckets == (2, 8)
    assert parse_overrides(["token_buckets=4:16"]) == {"token_buckets": ("4", "16")}
    assert EngineOptions(token_buckets=("4", "16")).token_buckets == (4, 16)
    assert EngineOptions().token_buckets is None


@pytest.mark.parametrize(
    ("buckets", "message"),
    [
        ((), "list of step sizes"),
        ("4,16", "list of step sizes"),
        ((0, 4), "positive integers"),
        (("four",), "positive integers"),
        ((True,), "positive integers"),
        ((4, 1024), "exceeds max_num_batched_tokens"),
    ],
)
def test_bad_token_buckets_are_clear_errors(buckets, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(token_buckets=buckets)


def test_the_budget_is_always_a_token_bucket():
    from jaxinfer.config import token_buckets

    assert token_buckets(64, (4, 16)) == (4, 16, 64)
    assert token_buckets(64, (64,)) == (64,)
    assert token_buckets(16) == (1, 2, 4, 6, 8, 12, 16)
