"""Sweep the Pallas kernels' tile sizes, warps and pipeline stages on a GPU.

    python -m tools.tune_pallas --shape=llama3_8b --budget_s=150 --output_json=tune.json

Cases (random bfloat16 inputs): decode attention (--batch requests of one token at --context,
and a long-context one: 8 requests at 4x --context), prefill attention (one request of
--prefill_len tokens) and the fused gate/up product at --batch and --prefill_len tokens. Every
configuration is checked against the reference (max abs error) and timed; the table lists each
case's configurations fastest first, with bandwidth (decode) or FLOP/s (prefill, FFN) as a
share of the measured ceilings. The sweep stops starting new configurations after --budget_s
and still writes what it measured. Defaults in the kernels come from this table.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.models.shapes import shape
from pallas_kernels.fused_ffn.kernel import gate_up_activation
from pallas_kernels.fused_ffn.reference import fused_ffn_reference
from pallas_kernels.gpu_lowering import LaunchConfig
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from tools.bench_inputs import attention_inputs
from tools.device_profile import kernel_times
from tools.device_rates import matmul_rate, memory_bandwidth, timed

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "llama3_8b", "Model shape (jaxinfer.models.shapes).")
flags.DEFINE_integer("batch", 32, "Decode requests / FFN decode tokens.")
flags.DEFINE_integer("context", 1024, "Decode context length.")
flags.DEFINE_integer("prefill_len", 4096, "Prefill tokens.")
flags.DEFINE_list("cases", ["ffn", "decode", "long_decode", "prefill"], "Cases to sweep.")
flags.DEFINE_float("budget_s", 150.0, "Start no new configuration after this many seconds.")
flags.DEFINE_string("output_json", None, "Also write the rows here.")
flags.DEFINE_integer("block_size", 16, "KV-cache block size.")
flags.DEFINE_bool(
    "interpret", False, "Run the kernels through Pallas' interpreter (a CPU check of the sweep)."
)
flags.DEFINE_integer("max_configs", None, "Sweep at most this many configurations per case.")

ROUNDS = 3  # timing rounds over all of a case's configurations
SAMPLE_S = 0.02  # each timing sample enqueues calls for about this long before waiting

ATTENTION_DECODE = [
    dict(kv_blocks_per_iter=p, launch=LaunchConfig(w, s), num_kv_splits=k)
    for p, w, s, k in itertools.product((4, 8), (4, 8), (2, 3), (None, 1))
]
ATTENTION_PREFILL = [
    dict(block_q=q, kv_blocks_per_iter=p, launch=LaunchConfig(w, s))
    for q, p, w, s in itertools.product((16, 32), (4, 8), (4, 8), (2, 3))
]
FFN = [
    dict(block_i=i, block_k=k, launch=LaunchConfig(w, s))
    for i, k, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))
]


def describe(config: dict) -> str:
    parts = []
    for key, value in config.items():
        if isinstance(value, LaunchConfig):
            parts.append(f"warps={value.num_warps} stages={value.num_stages}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def main(argv):
    del argv
    if jax.default_backend() != "gpu" and not FLAGS.interpret:
        raise SystemExit(
            "tune_pallas.py sweeps compiled GPU kernels; this machine has no GPU "
            "(--interpret runs the sweep through Pallas' interpreter, as a check)"
        )
    cfg = shape(FLAGS.shape)
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.float32 if FLAGS.interpret else jnp.bfloat16  # bfloat16 dots are slow on CPU
    bandwidth = memory_bandwidth()
    flops = matmul_rate(1024 if FLAGS.interpret else 8192, dtype)
    print(
        f"device: {jax.devices()[0].device_kind}; copy {bandwidth / 1e9:.0f} GB/s, "
        f"{jnp.dtype(dtype).name} matmul {flops / 1e12:.1f} TFLOP/s; jax {jax.__version__}"
    )
    begin = time.perf_counter()
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    scale = head_dim**-0.5
    rows = []

    def sweep(case, configs, make, args, reference, work, unit):
        """Each configuration compiled and checked, then timed: on a GPU by the device time of
        its kernels (a profiler trace of 10 calls: no host dispatch or gaps); elsewhere in
        ROUNDS rounds of wall time that visit every configuration in turn (the best round of
        each kept), so a clock that drifts during the sweep shifts all of them alike."""
        expected = np.asarray(jax.jit(reference)(*args), np.float32)
        ceiling = bandwidth if unit == "GB/s" else flops

        def emit(label, error, times):
            seconds = min(times)
            rate = work / seconds
            row = dict(
                case=case,
                config=label,
                ms=seconds * 1e3,
                spread=max(times) / seconds,
                max_abs_error=error,
                rate=rate / (1e9 if unit == "GB/s" else 1e12),
                unit=unit,
                percent_of_ceiling=100 * rate / ceiling,
            )
            rows.append(row)
            print(
                f"{case:12s} {label:58s} {row['ms']:8.3f} ms (rounds within "
                f"{100 * (row['spread'] - 1):.0f}%) err {error:.1e} "
                f"{row['rate']:8.1f} {unit} ({row['percent_of_ceiling']:.0f}%)",
                flush=True,
            )

        compiled = []
        for config in [None, *configs[: FLAGS.max_configs]]:  # None: the kernel's defaults
            if time.perf_counter() - begin > FLAGS.budget_s:
                print(f"budget spent: {case} stops before {describe(config or {})}")
                break
            label = "defaults" if config is None else describe(config)
            try:
                fn = jax.jit(make(config or {}))
                error = float(np.abs(np.asarray(fn(*args), np.float32) - expected).max())
            except Exception as exc:  # a configuration Triton rejects is reported, not fatal
                print(f"{case:12s} {label:58s} failed: {type(exc).__name__}: {exc}"[:300])
                continue
            if on_gpu:  # reported at once: a sweep cut short keeps what it measured
                emit(label, error, [sum(r["ms"] for r in kernel_times(fn, *args)) / 1e3])
            else:
                compiled.append((label, fn, error, []))
        for _ in range(ROUNDS):
            for _, fn, _, times in compiled:
                times.append(timed(fn, *args, repeats=5, sample_s=SAMPLE_S))
        for label, _, error, times in compiled:
            emit(label, error, times)

    itemsize = jnp.dtype(dtype).itemsize
    interpret = dict(interpret=True) if FLAGS.interpret else {}

    def attention(config):
        return lambda *a: ragged_paged_attention(*a, sm_scale=scale, **interpret, **config)

    def reference(*a):
        return ragged_paged_attention_reference(*a, sm_scale=scale)

    if "ffn" in FLAGS.cases:
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        keys = jax.random.split(jax.random.key(1), 3)
        gate_up = jax.random.normal(keys[0], (hidden, 2, inter), dtype) * hidden**-0.5
        eye = jnp.eye(inter, dtype=dtype)  # the reference's h: down = identity
        for tokens in (FLAGS.batch, FLAGS.prefill_len):
            x = jax.random.normal(keys[2], (tokens, hidden), dtype)
            sweep(
                f"gate_up t{tokens}",
                FFN,
                lambda config: lambda a, w: gate_up_activation(a, w, **interpret, **config),
                (x, gate_up),
                lambda a, w: fused_ffn_reference(a, w, eye),
                4 * tokens * hidden * inter,
                "TFLOP/s",
            )

    for case, batch, context in (
        ("decode", FLAGS.batch, FLAGS.context),
        ("long_decode", 8, 4 * FLAGS.context),
    ):
        if case in FLAGS.cases:
            args = attention_inputs(cfg, [1] * batch, [context] * batch, dtype, FLAGS.block_size)
            kv_bytes = 2 * batch * context * kv_heads * head_dim * itemsize
            name = f"{case} b{batch} c{context}"
            sweep(name, ATTENTION_DECODE, attention, args, reference, kv_bytes, "GB/s")
    if "prefill" in FLAGS.cases:
        n = FLAGS.prefill_len
        args = attention_inputs(cfg, [n], [n], dtype, FLAGS.block_size)
        causal_flops = 4 * heads * head_dim * n * (n + 1) / 2
        sweep(
            f"prefill {n}", ATTENTION_PREFILL, attention, args, reference, causal_flops, "TFLOP/s"
        )
    print("\nfastest per case:")
    for case in dict.fromkeys(r["case"] for r in rows):
        best = min((r for r in rows if r["case"] == case), key=lambda r: r["ms"])
        default = next((r for r in rows if r["case"] == case and r["config"] == "defaults"), None)
        ratio = f"{default['ms'] / best['ms']:.2f}x over defaults" if default else ""
        print(f"  {case:22s} {best['config']:50s} {best['ms']:.3f} ms {ratio}")
    if FLAGS.output_json:
        meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
        meta.update(memory_gb_s=bandwidth / 1e9, matmul_tflop_s=flops / 1e12)
        Path(FLAGS.output_json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    app.run(main)
