"""The `jaxinfer` command (jaxinfer.cli): subcommands onto the `python -m` entry points."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxinfer.cli import arguments, main


def test_serve_takes_the_model_as_its_first_argument():
    assert arguments("serve", ["some/folder", "--port=9000"]) == [
        "--model=some/folder",
        "--port=9000",
    ]
    assert arguments("serve", ["--port=9000"]) == ["--port=9000"]
    assert arguments("run-batch", ["x.jsonl"]) == ["x.jsonl"]  # only serve has a positional


def test_usage_and_unknown_commands(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "serve" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["sreve"])
    assert done.value.code == 2 and "unknown command 'sreve'" in capsys.readouterr().err


def test_serve_help_lists_the_entry_points_flags():
    shown = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in shown.stderr, shown.stderr  # (absl's --help exits 1)
    for flag in ("--port", "--api_key", "--max_num_seqs", "--coordinator_address"):
        assert flag in shown.stdout
