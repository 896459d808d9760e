"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time and
what JAX spent compiling (XLA backend compiles, tracing and lowering, persistent-cache hits),
and a summary by file.

    python -m tools.test_lanes -p tests.support.compile_report --compile_report=/tmp/costs
    python -m tests.support.compile_report /tmp/costs

Each pytest process (xdist workers included) appends one JSON line per test to
<dir>/costs-<pid>.jsonl. Programs compiled in processes a test starts (the multi-process and
tool tests) are not seen.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"
HITS = "/jax/compilation_cache/cache_hits"


class _Costs:
    def __init__(self, folder: Path):
        self.folder = folder
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.counts: collections.Counter[str] = collections.Counter()

    def on_duration(self, event: str, duration: float, **_) -> None:
        self.seconds[event] += duration
        self.counts[event] += 1

    def on_event(self, event: str, **_) -> None:
        self.counts[event] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        seconds, counts, start = dict(self.seconds), dict(self.counts), time.monotonic()
        yield
        record = {
            "test": item.nodeid,
            "wall": time.monotonic() - start,
            "compile": self.seconds[COMPILE] - seconds.get(COMPILE, 0.0),
            "compiles": self.counts[COMPILE] - counts.get(COMPILE, 0),
            "trace_lower": sum(self.seconds[e] - seconds.get(e, 0.0) for e in (TRACE, LOWER)),
            "saved": self.seconds[SAVED] - seconds.get(SAVED, 0.0),
            "hits": self.counts[HITS] - counts.get(HITS, 0),
        }
        with open(self.folder / f"costs-{os.getpid()}.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")


def pytest_addoption(parser):
    parser.addoption(
        "--compile_report",
        default=None,
        help="A folder for each test's wall and compile times (tests.support.compile_report).",
    )


def pytest_configure(config):
    folder = config.getoption("compile_report")
    if folder is None:
        return
    from jax import monitoring

    costs = _Costs(Path(folder))
    costs.folder.mkdir(parents=True, exist_ok=True)
    monitoring.register_event_duration_secs_listener(costs.on_duration)
    monitoring.register_event_listener(costs.on_event)
    config.pluginmanager.register(costs, "compile_report_costs")


def summary(folder: Path, top: int = 40) -> str:
    """Totals, then the files by wall time: wall, compile, trace + lower (s), compiles."""
    records = [
        json.loads(line)
        for path in sorted(folder.glob("costs-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for record in records:
        row = by_file[record["test"].split("::")[0]]
        row[0] += record["wall"]
        row[1] += record["compile"]
        row[2] += record["trace_lower"]
        row[3] += record["compiles"]
    total = [sum(row[i] for row in by_file.values()) for i in range(4)]
    lines = [
        f"{len(records)} tests: wall {total[0]:.0f} s, XLA compile {total[1]:.0f} s, trace + "
        f"lower {total[2]:.0f} s, {total[3]} compiles, "
        f"{sum(r['hits'] for r in records)} cache hits",
        f"{'wall':>7} {'compile':>7} {'trace':>6} {'count':>5}  file",
    ]
    for name, row in sorted(by_file.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"{row[0]:7.0f} {row[1]:7.0f} {row[2]:6.0f} {row[3]:5d}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
