"""Engine options from TOML files, as the entry points read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer.config_file import load_engine_options

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    load_engine_options(path)


def test_flags_override_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_seqs = 3\nblock_size = 32\n")
    options = load_engine_options(path, max_num_seqs=7, model=None)
    assert (options.max_num_seqs, options.block_size, options.model) == (7, 32, None)


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
