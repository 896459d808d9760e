"""The delta rule's kernels on one prefill chunk: the C++ kernel's chunked (WY / UT) form
against its recurrent form, and the pure-JAX reference's chunked form, in one process.

    python -m tools.bench_gated_delta --tokens=512,2048

One request of `tokens` tokens from a zero state, Qwen3-Next's linear-layer shape by default
(16 key heads, 32 value heads, head dims 128); each kernel jitted, warmed up, and timed as the
best of `repeats` calls (the call includes the wrapper's work: casts, the state gather and
scatter). The report gives the times and the chunked form's speed-up over the recurrent one.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from cpu_kernels.gated_delta.kernel import load_gated_delta
from pallas_kernels.gated_delta.reference import StateBatch, gated_delta_chunked

FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["512", "2048"], "Tokens of the prefill chunk.")
flags.DEFINE_integer("key_heads", 16, "Key heads.")
flags.DEFINE_integer("value_heads", 32, "Value heads.")
flags.DEFINE_integer("head_dim", 128, "Key and value head dims.")
flags.DEFINE_integer("repeats", 3, "Timed calls per point (the best is kept).")
flags.DEFINE_bool(
    "reference", False, "Also time the pure-JAX chunked reference (slow: minutes at 2048 tokens)."
)
flags.DEFINE_string("output_json", None, "Also write the report here.")


def inputs(tokens: int) -> tuple:
    rng = np.random.default_rng(0)
    hk, hv, dim = FLAGS.key_heads, FLAGS.value_heads, FLAGS.head_dim
    q, k = (rng.standard_normal((tokens, hk, dim), np.float32) for _ in range(2))
    v = rng.standard_normal((tokens, hv, dim), np.float32)
    g = np.full((tokens, hv), -0.05, np.float32)
    beta = np.full((tokens, hv), 0.5, np.float32)
    states = np.zeros((2, hv, dim, dim), np.float32)
    batch = StateBatch(
        np.asarray([0, tokens], np.int32),
        np.zeros(1, np.int32),
        np.ones(1, bool),
        np.ones(1, np.int32),
    )
    return q, k, v, g, beta, states, batch


def best_seconds(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv):
    del argv
    with tempfile.TemporaryDirectory() as build_dir:
        kernel = load_gated_delta(Path(build_dir))
        kernels = {
            "cpu_recurrent": jax.jit(functools.partial(kernel, chunk=0)),
            "cpu_chunked": jax.jit(kernel),
        }
        if FLAGS.reference:
            kernels["reference_chunked"] = jax.jit(gated_delta_chunked)
        report = {"tokens": [int(t) for t in FLAGS.tokens], "seconds": {}}
        for name, fn in kernels.items():
            report["seconds"][name] = [best_seconds(fn, inputs(t)) for t in report["tokens"]]
    seconds = report["seconds"]
    report["chunked_speedup"] = [
        r / c for r, c in zip(seconds["cpu_recurrent"], seconds["cpu_chunked"], strict=True)
    ]
    for index, tokens in enumerate(report["tokens"]):
        times = ", ".join(f"{name} {seconds[name][index] * 1e3:.1f} ms" for name in seconds)
        print(f"{tokens} tokens: {times}; chunked {report['chunked_speedup'][index]:.2f}x")
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    app.run(main)
