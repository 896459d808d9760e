"""Runs the test suite by marker (`make test`), or the fast lane alone (`make check`).

Markers say what a test costs (pyproject.toml): `engine` (builds engines of its own on tiny
models, or runs a tool end to end), `slow` (kernel sweeps), `default_model`, `multiprocess`,
`browser`; a test with none is fast (unit, kernel, and tiny-model engine, server and batch
tests on one shared engine). A machine here has two
cores, and much of a test's time is compilation, which uses one. So the lanes run side by side:
the fast and the engine tests on two pytest-xdist workers, which take test files as they free
up (so the slow files spread by what they cost, not by name), beside the default model's tests
and the multi-process and browser ones, each lane one process running one long chain of tests.
Four processes share the two cores until the two single-process lanes end; run one after the
other, a core would idle at each lane's tail. Each pytest process keeps the engines its tests
build, whose compiled programs hold thousands of memory maps: one process for everything would
pass vm.max_map_count (65530), where XLA's compiler crashes, so no process runs more than half
the engine tests. Every process shares one compilation cache for the run (tests/conftest.py):
a program compiled by one is loaded by the others.

Most of a tiny model's test is compiling it, and most of compiling is LLVM optimizing the
code XLA emits: the tiny-model, multi-process and browser lanes run with LLVM's optimization
off (XLA_FLAGS --xla_backend_optimization_level=0: the engine tests run little code, and
compile much less; docs/benchmarks.md has the suite's times). The default model's lane and
the tests of batch invariance (marked `invariance`: bit-identical results must hold in the
code as served, whose vectorized loops may round otherwise) keep XLA's defaults, as does
`make check`.

    python -m tools.test_lanes [--check] [extra pytest arguments]

Each process's output is shown when its stage ends, and every failed test's line again at the end;
the exit status is the first failure's.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time

FAST = "not (engine or slow or default_model or multiprocess or browser)"
ON_TWO_WORKERS = ("-n", "2", "--dist", "loadfile")
QUICK_COMPILE = "--xla_backend_optimization_level=0"  # (XLA_FLAGS: LLVM's optimization off)

# Stages in turn; in each, pytest processes side by side, as (marker expression, arguments,
# whether XLA compiles quickly).
STAGES = (
    (
        (
            "not (default_model or invariance or multiprocess or browser)",
            ("tests", *ON_TWO_WORKERS),
            True,
        ),
        ("(default_model or invariance) and not multiprocess", ("tests",), False),
        ("multiprocess or browser", ("tests",), True),
    ),
)
# make check: the fast lane alone, on both cores.
CHECK = (((FAST, ("tests", *ON_TWO_WORKERS), False),),)


def command(marker: str, args, cache_dir: str, extra: list[str]) -> str:
    """One pytest process as a shell command (a process that finds no test of its markers,
    pytest's status 5, has not failed)."""
    words = [sys.executable, "-m", "pytest", "-q", "-m", marker]
    words += [f"--compilation_cache_dir={cache_dir}", *args, *extra]
    return f"({shlex.join(words)} || [ $? -eq 5 ])"


def environment(quick: bool) -> dict[str, str]:
    """The environment of a lane's pytest process (and of the processes its tests start)."""
    env = dict(os.environ)
    if quick:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {QUICK_COMPILE}".strip()
    return env


def main() -> int:
    args = sys.argv[1:]
    check = "--check" in args
    extra = [a for a in args if a != "--check"]
    stages = CHECK if check else STAGES
    start = time.monotonic()
    status = 0
    failures: list[str] = []  # every lane's failed tests, repeated at the end
    with contextlib.ExitStack() as stack:
        cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxinfer-test-xla-"))
        for stage in stages:
            running = []
            for marker, stage_args, quick in stage:
                log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
                process = subprocess.Popen(
                    command(marker, stage_args, cache_dir, extra),
                    shell=True,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment(quick),
                )
                running.append((marker, process, log))
            for marker, process, log in running:
                code = process.wait()
                log.seek(0)
                text = log.read()
                print(f"===== -m {marker!r} (exit {code}) =====", flush=True)
                sys.stdout.write(text)
                status = status or code
                failures += [f"{marker}: {line}" for line in text.splitlines() if _failed(line)]
            print(f"===== {time.monotonic() - start:.0f} s so far =====", flush=True)
            if status:
                break
    for line in failures:  # last, where a log's tail shows them
        print(line)
    print(f"===== all: {time.monotonic() - start:.0f} s, exit {status} =====")
    return status


def _failed(line: str) -> bool:
    """A line of pytest's short summary that names a failed test or an error."""
    return line.startswith(("FAILED ", "ERROR "))


if __name__ == "__main__":
    sys.exit(main())
