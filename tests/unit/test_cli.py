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
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    text = shown.stdout
    groups = ["serve flags:", "Engine options", "Several processes"]
    assert all(group in text for group in groups), text[:500]
    own, engine, processes = (
        text[text.index(a) : text.index(b)] if b else text[text.index(a) :]
        for a, b in zip(groups, [*groups[1:], None], strict=True)
    )
    assert "--port\n" in own and "(default: 8000)" in own and "--api_key\n" in own
    assert "--max_num_seqs\n" in engine and "--port\n" not in engine
    assert "--coordinator_address\n" in processes and "--control_host\n" in processes


@pytest.mark.parametrize("command, flag", [("run-batch", "--input"), ("bench", "--rounds")])
def test_every_command_lists_its_flags(command, flag):
    shown = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0 and f"{flag}\n" in shown.stdout, shown.stderr[-2000:]
    assert "--max_num_seqs\n" in shown.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("jaxinfer ")


def test_the_readme_table_of_serve_flags_is_the_code_s():
    """The README's table of the server's flags is what `jaxinfer serve --help_markdown`
    generates from the flags themselves (regenerate it when a flag changes)."""
    from pathlib import Path

    shown = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "serve", "--help_markdown"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("<!-- serve flags:")
    table = readme[readme.index("\n", start) + 1 : readme.index("<!-- end serve flags -->")]
    assert table == shown.stdout
    assert "| `--port` | `8000` |" in table and "| `--api_key_file` |" in table
