"""Server start-up with JAX's persistent compilation cache: the first start (empty cache)
against the second (the same configuration again).

    python -m tools.bench_startup

Starts `python -m jaxinfer.serve` twice with a fresh --compilation_cache_dir, and times each
from launch until /health answers 200; prints both, their ratio, and the warm-up line of each
(token buckets, programs compiled and loaded from the cache).
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


def start_seconds(cache_dir: str) -> tuple[float, str]:
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
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=60)
    # the summary line (the progress lines before it say "done")
    summary = (line for line in output.splitlines() if "warm-up:" in line and "buckets," in line)
    warmup = next(summary, "")
    return seconds, warmup.split("warm-up:")[-1].strip()


def main(argv):
    del argv
    with tempfile.TemporaryDirectory() as cache_dir:
        first, first_warmup = start_seconds(cache_dir)
        second, second_warmup = start_seconds(cache_dir)
    print(f"first start (empty cache): {first:.1f} s; warm-up {first_warmup}")
    print(f"second start (cached):     {second:.1f} s; warm-up {second_warmup}")
    print(f"ratio first / second: {first / second:.2f}x")


if __name__ == "__main__":
    app.run(main)
