"""Runs the test suite as pytest processes in lanes chosen by marker (`make test`), or the
fast lane alone (`make check`).

Markers say what a test costs (pyproject.toml): `engine` (builds engines of its own on tiny
models), `default_model`, `multiprocess`, `browser`; a test with none is fast (unit, kernel,
and tiny-model engine and server tests on shared engines). A machine here has two cores and
much of a test's time is compilation, which uses one, so `make test` runs two lanes side by
side, each a few pytest processes in turn, balanced by what their markers cost. Each pytest
process keeps the engines its tests build, whose compiled programs hold thousands of memory
maps: one process for everything would pass vm.max_map_count (65530), where XLA's compiler
crashes, so the engine tests take two processes. All processes share one compilation cache
for the run (tests/conftest.py), so a program compiled by one is loaded by the others.

    python -m tools.test_lanes [--check] [extra pytest arguments]

Each lane's output is shown when it ends; the exit status is the first failing process's.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
import tempfile
import time

FAST = "not (engine or default_model or multiprocess or browser)"

# Each lane: its pytest processes in turn, as (marker expression, paths).
LANES = (
    (
        ("engine and not (default_model or multiprocess or browser)", ("tests/engine",)),
        ("default_model and not multiprocess", ("tests",)),
    ),
    (
        (FAST, ("tests",)),
        (
            "engine and not (default_model or multiprocess or browser)",
            ("tests/server", "tests/kernels", "tests/unit", "tests/tools"),
        ),
        ("multiprocess or browser", ("tests",)),
    ),
)
CHECK = ((FAST, ("tests",)),)


def lane_script(processes, cache_dir: str, extra: list[str]) -> str:
    """One lane as a shell command: its pytest processes in turn, stopping at a failure (a
    process that finds no test of its markers, pytest's status 5, is not one)."""
    commands = [
        shlex.join(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-m",
                marker,
                f"--compilation_cache_dir={cache_dir}",
                *paths,
                *extra,
            ]
        )
        for marker, paths in processes
    ]
    return " && ".join(f"({command} || [ $? -eq 5 ])" for command in commands)


def main() -> int:
    args = sys.argv[1:]
    check = "--check" in args
    extra = [a for a in args if a != "--check"]
    lanes = (CHECK,) if check else LANES
    start = time.monotonic()
    status = 0
    with contextlib.ExitStack() as stack:
        cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxinfer-test-xla-"))
        running = []
        for processes in lanes:
            log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
            process = subprocess.Popen(
                lane_script(processes, cache_dir, extra),
                shell=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            running.append((processes, process, log))
        for index, (processes, process, log) in enumerate(running):
            code = process.wait()
            log.seek(0)
            names = [marker for marker, _ in processes]
            print(f"===== lane {index + 1}: {names} (exit {code}) =====", flush=True)
            sys.stdout.write(log.read())
            status = status or code
    print(f"===== all lanes: {time.monotonic() - start:.0f} s, exit {status} =====")
    return status


if __name__ == "__main__":
    sys.exit(main())
