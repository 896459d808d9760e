"""Runs the test suite as pytest processes in two lanes side by side (`make test`).

Each pytest process keeps the engines its tests build, and every engine's compiled programs
hold thousands of memory maps: one process for the whole suite passes vm.max_map_count
(65530), where XLA's compiler crashes. So the suite runs as four processes; two lanes run
them two at a time, since much of a test's time is compilation, which uses one core. Each
lane's output is shown when it ends; the exit status is the first failing process's.

    python -m tools.test_lanes [extra pytest arguments]
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time

LANES = (
    (("tests/engine/test_[a-m]*.py",), ("tests/kernels", "tests/tools", "tests/unit")),
    (("tests/engine/test_[n-z]*.py",), ("tests/server",)),
)


def lane_script(groups, extra: list[str]) -> str:
    """One lane as a shell command: its pytest processes in turn, stopping at a failure."""
    commands = [
        " ".join([sys.executable, "-m", "pytest", "-q", *group, *extra]) for group in groups
    ]
    return " && ".join(commands)


def main() -> int:
    extra = sys.argv[1:]
    start = time.monotonic()
    status = 0
    with contextlib.ExitStack() as stack:
        running = []
        for groups in LANES:
            log = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
            process = subprocess.Popen(
                lane_script(groups, extra), shell=True, stdout=log, stderr=subprocess.STDOUT
            )
            running.append((groups, process, log))
        for index, (groups, process, log) in enumerate(running):
            code = process.wait()
            log.seek(0)
            print(f"===== lane {index + 1}: {groups} (exit {code}) =====", flush=True)
            sys.stdout.write(log.read())
            status = status or code
    print(f"===== all lanes: {time.monotonic() - start:.0f} s, exit {status} =====")
    return status


if __name__ == "__main__":
    sys.exit(main())
