"""Server start-up with JAX's persistent compilation cache: the first start (empty cache)
against the second (the same configuration again).

    python -m tools.bench_startup

Starts `python -m jaxinfer.serve` twice with a fresh --compilation_cache_dir, and times each
from launch until /health answers 200; prints both, their ratio, the warm-up line of each
(token buckets, programs compiled and loaded from the cache) and, where the server compiles
its other buckets while serving (its default warmup "auto"), when the last of them was ready
(/metrics: jaxinfer:token_buckets_compiling 0).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import httpx
from absl import app, flags

from jaxinfer.server.background import free_port

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Engine options file passed to the server.")
flags.DEFINE_integer("timeout", 900, "Seconds a start may take.")


def buckets_compiling(port: int) -> float | None:
    """The server's jaxinfer:token_buckets_compiling, or None if it cannot be read."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.TransportError:
        return None
    for line in text.splitlines():
        if line.startswith("jaxinfer:token_buckets_compiling "):
            return float(line.split()[1])
    return None


def start_seconds(cache_dir: str) -> tuple[float, float | None, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "jaxinfer.serve",
        f"--port={port}",
        f"--compilation_cache_dir={cache_dir}",
    ]
    if FLAGS.config:
        command.append(f"--config={FLAGS.config}")
    start = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while time.perf_counter() - start < FLAGS.timeout:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited: {server.stdout.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            raise TimeoutError("the server did not start")
        seconds = time.perf_counter() - start
        all_ready = None
        while time.perf_counter() - start < FLAGS.timeout:
            if buckets_compiling(port) == 0:
                all_ready = time.perf_counter() - start
                break
            time.sleep(0.5)
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=60)
    # the summary line (the progress lines before it say "done")
    summary = (line for line in output.splitlines() if "warm-up:" in line and "buckets," in line)
    warmup = next(summary, "")
    return seconds, all_ready, warmup.split("warm-up:")[-1].strip()


def main(argv):
    del argv
    with tempfile.TemporaryDirectory() as cache_dir:
        first, first_ready, first_warmup = start_seconds(cache_dir)
        second, second_ready, second_warmup = start_seconds(cache_dir)

    def ready(seconds: float | None) -> str:
        return "" if seconds is None else f"; every bucket compiled at {seconds:.1f} s"

    print(f"first start (empty cache): {first:.1f} s; warm-up {first_warmup}{ready(first_ready)}")
    print(
        f"second start (cached):     {second:.1f} s; warm-up {second_warmup}{ready(second_ready)}"
    )
    print(f"ratio first / second: {first / second:.2f}x")


if __name__ == "__main__":
    app.run(main)
