"""Meshes of several CPU devices in one process, next to processes that keep both cores busy
(issue 40): a deep model under per-layer execution dispatches a program per layer, and a
host that ran more than XLA:CPU's 32 programs ahead of its devices deadlocked the client's
thread pool (one thread blocked in XLA's in-flight throttle, the others in a collective
waiting for the device it would have run; XLA aborted the process after 40 s). The runner
now keeps each step's layers within a window (jaxinfer.parallel.dispatch)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from tests.support.models import make_tiny_model

pytestmark = pytest.mark.multiprocess

HOG = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """48 layers of 12 heads (splits 3 and 4 ways)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("deep"),
        num_hidden_layers=48,
        num_attention_heads=12,
        num_key_value_heads=12,
        hidden_size=96,
        intermediate_size=128,
    )


@contextlib.contextmanager
def busy_cores(count: int = 2):
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run_mesh(model, tp: int, rounds: int) -> list:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(tp)}
    command = [sys.executable, "-m", "tests.support.mesh_job", str(model), str(tp), str(rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tp", [3, 4])
def test_a_deep_mesh_completes_next_to_busy_cores_repeatedly(deep_model, tp):
    with busy_cores():
        runs = run_mesh(deep_model, tp, rounds=3)
    assert len(runs) == 3 and all(len(tokens) == 40 for run in runs for tokens in run)
    assert runs[0] == runs[1] == runs[2]  # greedy: each round the same
