"""Jobs of two processes on this machine: jax.distributed over the loopback, gloo collectives,
the model split over both processes' CPU devices (jaxinfer.engine.lockstep), each against
the same job run as one process: run_batch (unseeded sampling, a kill and a resume), the
server driven with the openai client (streams, a client that leaves, SIGTERM, a follower that
dies), the LLM API on the default model (over three processes: its 9 heads split in 3),
and the schedule check catching a divergence.

Every job's processes share one compilation cache, so only the first of each kind compiles.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from jaxinfer.server.background import free_port
from tests.support.batch import assert_same, line, read_records

pytestmark = pytest.mark.multiprocess

# One CPU device per process, the model split over both (tp 2); one process: two devices.
ENGINE_FLAGS = (
    "--max_num_seqs=2",
    "--max_num_batched_tokens=16",
    "--token_buckets=2",  # and 16: two programs to compile per process
    "--block_size=8",
    "--num_kv_blocks=96",
    "--max_model_len=128",
    "--tensor_parallel_size=2",
    "--random_seed=7",
    "--warmup=all",  # every bucket before serving: one process's steps pad as two processes'
)
TIMEOUT = 300  # seconds any job may take to start


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("xla")


def start(module, flags, cache_dir, log_dir, processes=2, devices=(1, 1), name="job"):
    """The processes of a job (python -m module flags ...), each with its log file."""
    port = free_port()
    started = []
    for i in range(processes):
        command = [sys.executable, "-m", module, *flags, f"--compilation_cache_dir={cache_dir}"]
        if processes > 1:
            command += [
                f"--coordinator_address=127.0.0.1:{port}",
                f"--num_processes={processes}",
                f"--process_id={i}",
            ]
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices[i])}
        log = (log_dir / f"{name}.{i}.log").open("w")
        started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    return started


def logs(log_dir, name, processes=2) -> str:
    return "\n".join((log_dir / f"{name}.{i}.log").read_text()[-3000:] for i in range(processes))


def wait_all(processes, timeout=TIMEOUT) -> list[int]:
    return [p.wait(timeout=timeout) for p in processes]


@contextlib.contextmanager
def killed_at_exit(processes):
    try:
        yield processes
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


# -- run_batch ---------------------------------------------------------------------------


def batch_lines(count: int, max_tokens: int) -> list[str]:
    """Unseeded sampled completions (logprobs of each token) and greedy chats, in turn."""
    return [
        line(
            f"line-{i}",
            "/v1/completions",
            {"prompt": f"Fox number {i} says", "max_tokens": max_tokens, "temperature": 1.0,
             "logprobs": 1, "ignore_eos": True},
        )
        if i % 2 == 0
        else line(
            f"line-{i}",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"Fox {i}?"}], "max_tokens": max_tokens,
             "temperature": 0, "logprobs": True, "top_logprobs": 1},
        )
        for i in range(count)
    ]  # fmt: skip


def answers(path: Path) -> dict[str, list]:
    """custom_id -> the choices of its response body."""
    return {r["custom_id"]: r["response"]["body"]["choices"] for r in read_records(path)}


def test_batch_across_two_processes_answers_as_one_and_resumes(tiny_model_dir, cache_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    count = 12
    source.write_text("\n".join(batch_lines(count, max_tokens=32)) + "\n")

    def flags(output):
        return (
            f"--model={tiny_model_dir}",
            f"--input={source}",
            f"--output={output}",
            "--noprogress",
            *ENGINE_FLAGS,
        )

    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    # Jobs one at a time here: each compiles for minutes on two cores, and side by side
    # they would share them.
    job = start("jaxinfer.run_batch", flags(one), cache_dir, tmp_path, 1, (2,), "one")
    with killed_at_exit(job):
        assert wait_all(job) == [0], logs(tmp_path, "one", 1)
    job = start("jaxinfer.run_batch", flags(two), cache_dir, tmp_path, name="two")
    with killed_at_exit(job):
        assert wait_all(job) == [0, 0], logs(tmp_path, "two")
    # Only process 0 writes; unseeded samples drew the same seeds (from the line's id).
    assert not list(tmp_path.glob("two.jsonl.process*"))
    expected = answers(one)
    assert len(expected) == count
    assert_same(answers(two), expected)

    # Killed midway (process 0: its follower must stop too), then resumed.
    resumed = tmp_path / "resumed.jsonl"
    job = start("jaxinfer.run_batch", flags(resumed), cache_dir, tmp_path, name="killed")
    with killed_at_exit(job):
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and job[0].poll() is None:
            if resumed.exists() and resumed.read_text().count("\n") >= 2:
                break
            time.sleep(0.01)
        job[0].send_signal(signal.SIGKILL)
        # Its leader went away (mid-collective, or between steps): an error, not a hang.
        assert job[1].wait(timeout=60) != 0
    before = len(read_records(resumed))
    assert 2 <= before < count, "the run was not interrupted midway"
    job = start(
        "jaxinfer.run_batch", (*flags(resumed), "--resume"), cache_dir, tmp_path, name="resume"
    )
    with killed_at_exit(job):
        assert wait_all(job) == [0, 0], logs(tmp_path, "resume")
    records = read_records(resumed)
    assert sorted(r["custom_id"] for r in records) == sorted(expected)  # one per line
    assert_same(answers(resumed), expected)


# -- the server --------------------------------------------------------------------------


def healthy(url: str, processes, timeout=TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in processes), "a server process exited"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def serve(model_dir, cache_dir, log_dir, name, processes=2, devices=(1, 1)):
    port = free_port()
    flags = (
        f"--model={model_dir}",
        f"--port={port}",
        "--served_model_name=tiny",
        "--check_schedule" if processes > 1 else "--nocheck_schedule",
        *ENGINE_FLAGS,
    )
    job = start("jaxinfer.serve", flags, cache_dir, log_dir, processes, devices, name)
    return job, f"http://127.0.0.1:{port}"


def running(url: str) -> float:
    for text in httpx.get(f"{url}/metrics").text.splitlines():
        if text.startswith("jaxinfer:num_requests_running"):
            return float(text.split()[-1])
    raise AssertionError("no running-requests metric")


def exchanges(url: str) -> list:
    """A non-streamed completion with logprobs and a streamed chat, greedy."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    completion = client.completions.create(
        model="tiny", prompt="The fox", max_tokens=16, temperature=0, logprobs=2
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    sampled = client.completions.create(
        model="tiny", prompt="A fox", max_tokens=12, temperature=1.0, seed=3
    )
    return [
        completion.choices[0].text,
        completion.choices[0].logprobs.token_logprobs,
        streamed,
        sampled.choices[0].text,
    ]


def test_server_across_two_processes(tiny_model_dir, cache_dir, tmp_path):
    one, reference = serve(tiny_model_dir, cache_dir, tmp_path, "one", 1, (2,))
    with killed_at_exit(one):
        healthy(reference, one)
        expected = exchanges(reference)
    two, url = serve(tiny_model_dir, cache_dir, tmp_path, "two")
    with killed_at_exit(two):
        healthy(url, two)
        assert_same(exchanges(url), expected)

        # A client that leaves mid-stream: the request ends on both processes (a follower that
        # kept it would diverge, and --check_schedule would stop the engine).
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 100, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            chunks = 0
            for text in r.iter_lines():
                chunks += text.startswith("data: {")
                if chunks == 3:
                    break
        deadline = time.monotonic() + 30
        while running(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(url) == 0
        assert_same(exchanges(url), expected)
        assert httpx.get(f"{url}/health").status_code == 200

        # SIGTERM to process 0 ends both.
        two[0].send_signal(signal.SIGTERM)
        codes = wait_all(two, timeout=60)
        assert codes[0] in (0, -signal.SIGTERM) and codes[1] == 0, logs(tmp_path, "two")
        assert "Traceback" not in logs(tmp_path, "two")


def test_a_follower_that_dies_fails_the_server_not_hangs_it(tiny_model_dir, cache_dir, tmp_path):
    job, url = serve(tiny_model_dir, cache_dir, tmp_path, "dies")
    with killed_at_exit(job):
        healthy(url, job)
        body = {"model": "tiny", "prompt": "Go", "max_tokens": 120, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                job[1].send_signal(signal.SIGKILL)
                rest = list(lines)  # the stream ends, with an error event
            assert any("error" in text for text in rest), rest
            deadline = time.monotonic() + 30
            while client.get(f"{url}/health").status_code != 503:
                assert time.monotonic() < deadline, "/health still reports a healthy engine"
                time.sleep(0.1)
            after = client.post(f"{url}/v1/completions", json={**body, "max_tokens": 4})
            assert after.status_code >= 500
    # (the whole log: the failed requests' own errors may follow the message by more than
    # the 3000 characters `logs` shows)
    log = (tmp_path / "dies.0.log").read_text()
    assert "process 1 of the job failed" in log, logs(tmp_path, "dies")


# -- the Python API and the schedule check -------------------------------------------------


def run_script(spec: dict, tmp_path: Path, devices: tuple[int, ...], name: str):
    """tests.support.multiprocess_job with `spec` as a job of len(devices) processes (one if 1)."""
    port = free_port()
    started = []
    for i, count in enumerate(devices):
        distributed = None
        if len(devices) > 1:
            distributed = {
                "coordinator_address": f"127.0.0.1:{port}",
                "num_processes": len(devices),
                "process_id": i,
            }
        path = tmp_path / f"{name}.{i}.json"
        path.write_text(json.dumps({**spec, "distributed": distributed}))
        env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(count)}
        log = (tmp_path / f"{name}.{i}.log").open("w")
        command = [sys.executable, "-m", "tests.support.multiprocess_job", str(path)]
        started.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    return started


def test_default_model_across_three_processes_matches_one(model_cache_dir, cache_dir, tmp_path):
    """The LLM API, every process running the same script: the default model split three
    ways (9 query heads, 3 KV heads) over three processes of one device against one process
    of three devices: the same greedy tokens and logprobs. (Three processes, since JAX wants
    the same device count in each. A two-process mesh of 2+2 devices once hung here, most likely
    in XLA:CPU's thread-pool deadlock that jaxinfer.parallel.dispatch now avoids.)"""
    options = {
        "cache_dir": str(model_cache_dir),
        "compilation_cache_dir": str(cache_dir),
        "tensor_parallel_size": 3,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 16,
        "token_buckets": [2],
        "max_model_len": 128,
        "num_kv_blocks": 64,
    }
    prompts = [[1, 504, 3458, 314, 4195, 25], [1, 2683, 5212, 30], [1, 9690, 28]]
    spec = {
        "mode": "generate",
        "model": None,
        "options": options,
        "prompts": prompts,
        "params": {"temperature": 0, "max_tokens": 8, "logprobs": 1, "ignore_eos": True},
    }
    # One after the other (see the batch test).
    one = run_script({**spec, "output": str(tmp_path / "one.json")}, tmp_path, (3,), "one")
    with killed_at_exit(one):
        assert wait_all(one, 600) == [0], logs(tmp_path, "one", 1)
    two = run_script({**spec, "output": str(tmp_path / "two.json")}, tmp_path, (1, 1, 1), "two")
    with killed_at_exit(two):
        assert wait_all(two, 600) == [0, 0, 0], logs(tmp_path, "two", 3)
    expected = json.loads((tmp_path / "one.json").read_text())
    got = json.loads((tmp_path / "two.json").read_text())
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert_same(got, expected)


def test_check_schedule_stops_both_processes_at_a_divergence(tiny_model_dir, cache_dir, tmp_path):
    spec = {
        "mode": "diverge",
        "model": str(tiny_model_dir),
        "options": {
            "compilation_cache_dir": str(cache_dir),
            "tensor_parallel_size": 2,
            "max_num_seqs": 2,
            "max_num_batched_tokens": 16,
            "token_buckets": [2],
            "block_size": 8,
            "num_kv_blocks": 96,
            "max_model_len": 128,
        },
        "prompts": [[5, 6, 7], [8, 9]],
        "params": {"temperature": 0, "max_tokens": 5, "ignore_eos": True},
        "output": str(tmp_path / "diverge"),
    }
    job = run_script(spec, tmp_path, (1, 1), "diverge")
    with killed_at_exit(job):
        wait_all(job)
    for i in range(2):
        said = (tmp_path / f"diverge.{i}").read_text()
        assert "check_schedule: step" in said and "differs from process 0's" in said, said
