"""Every registered kernel implementation on the same inputs: time and error against the
reference, and on a GPU the share of the device's measured ceilings.

    python -m tools.kernel_bench --shapes=smollm2,llama3_8b --output_json=kernels.json

Cases per model shape (random inputs): decode attention (each of --decode_batches requests of
one new token at each of --contexts), prefill attention (one request of --prefill_len tokens),
the FFN at --batch and --prefill_len tokens, a MoE layer's experts (the gate/up grouped matmul
of 64 experts of the FFN's width / 8, top 8) at --batch tokens (and --prefill_len on a GPU), and
the residual add + RMSNorm at --batch tokens, and the down projection [E, I] in GGUF block
formats (pallas_kernels.gguf_matmul's planes of random Q4_K, Q6_K and Q8_0 blocks; bandwidth of
the planes read, beside XLA's matmul of the dense weight in the model dtype) at --batch
tokens. Decode attention is
reported as bandwidth (K/V bytes read per second, scales included) against a measured
device-to-device copy, for each of --kv_cache_dtypes (a quantized cache is also reported as a
speed-up over the model-dtype cache, same kernel, same run: a ratio that holds across noisy
machines);
prefill attention and the FFN as FLOP/s against a measured matmul of the same dtype. On CPU
the Pallas kernels run through the interpreter (slow; the numbers check correctness only), so
the default sizes there are small; the C++ attention kernel ("cpu") runs compiled.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cpu_kernels.build import KernelBuildError
from cpu_kernels.gguf_matmul.reference import random_rows
from cpu_kernels.paged_attention.kernel import load_paged_attention
from jaxinfer.config import EngineOptions
from jaxinfer.layers.kernel_registry import default_registry
from jaxinfer.layers.kv_cache import KVCacheFormat
from jaxinfer.models.shapes import shape
from pallas_kernels.gguf_matmul.kernel import gguf_matmul
from pallas_kernels.gguf_matmul.reference import dequantize, gguf_matmul_reference, to_planes
from pallas_kernels.ragged_paged_attention.kv_quant import quantize_cache
from tools.bench_inputs import attention_inputs
from tools.device_profile import kernel_times
from tools.device_rates import matmul_rate, memory_bandwidth, timed

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["smollm2", "llama3_8b"], "Model shapes (jaxinfer.models.shapes).")
flags.DEFINE_integer("batch", None, "FFN and norm tokens (default: 32 on GPU, 4 on CPU).")
flags.DEFINE_list(
    "decode_batches", None, "Decode attention requests (default: 32,128 on GPU, 4 on CPU)."
)
flags.DEFINE_list(
    "contexts", None, "Decode attention context lengths (default: 1024,8192 GPU, 128 CPU)."
)
flags.DEFINE_integer("prefill_len", None, "Prefill tokens (default: 4096 GPU, 64 CPU).")
flags.DEFINE_integer("block_size", 16, "KV-cache block size.")
flags.DEFINE_list(
    "kv_cache_dtypes", ["auto"], "Decode attention caches: auto (the dtype), int8, fp8_e4m3, ..."
)
flags.DEFINE_list("impls", None, "Implementations to run (default: every one that runs here).")
flags.DEFINE_integer("repeats", 10, "Timed calls per case (the median is reported).")
flags.DEFINE_string("output_json", None, "Also write the rows here.")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def runnable(names: list[str], cpu_kernel: bool) -> list[str]:
    """`cpu_kernel`: the C++ attention kernel is built and registered here."""
    if FLAGS.impls:
        return [n for n in names if n in FLAGS.impls]
    skip = ("pallas_interpret",) if on_gpu() else ("pallas",)
    return [n for n in names if n not in skip and (n != "cpu" or cpu_kernel)]


def decode_call(scale: float, scale_layout: str | None):
    """The attention call a decode case times: its last argument the cache's scales when it is
    quantized (laid out as `scale_layout`)."""

    def make(fn):
        if scale_layout is not None:
            return lambda *a: fn(
                *a[:-1], sm_scale=scale, kv_scales=a[-1], kv_scale_layout=scale_layout
            )
        return lambda *a: fn(*a, sm_scale=scale)

    return make


def time_against_first(calls: dict, args) -> dict:
    """{name: (seconds, max abs error vs the first call's output, wall seconds)} of each jitted
    call on `args` (arguments of the jitted call, not constants it closes over, which XLA would
    fold away at compile time). On a GPU `seconds` is the device time of the call's kernels
    (a profiler trace: what the kernels cost, without the host's dispatch or the gaps between
    calls), else the wall time."""
    results = {}
    expected = None
    for name, call in calls.items():
        fn = jax.jit(call)
        out = fn(*args)
        out = np.asarray(out[0] if isinstance(out, tuple) else out, np.float32)
        expected = out if expected is None else expected
        error = float(np.abs(out - expected).max())
        wall = timed(fn, *args, repeats=FLAGS.repeats)
        seconds = wall
        if on_gpu():
            seconds = sum(row["ms"] for row in kernel_times(fn, *args, calls=10)) / 1e3
        results[name] = (seconds, error, wall)
    return results


def run_case(kind, impls, registry, make_call, args, reference_name="reference"):
    """{impl: (seconds, max abs error vs the reference)} of the registry's `kind`."""
    names = [reference_name] + [n for n in impls if n != reference_name]
    return time_against_first({n: make_call(registry.get(kind, n)) for n in names}, args)


BLOCK_FORMATS = ("Q4_K", "Q6_K", "Q8_0")


def block_case(x, planes, dense) -> dict:
    """{impl: (seconds, max abs error vs the reference)} of x @ W^T for W in block planes
    (the Pallas kernel, interpreted off a GPU) and XLA's matmul of the dense weight."""
    pallas = "pallas" if on_gpu() else "pallas_interpret"
    calls = {  # each takes (x, codes, scale, bias, dense) and uses its own
        "reference": lambda a, c, s, b, w: gguf_matmul_reference(a, c, s, b),
        pallas: lambda a, c, s, b, w: gguf_matmul(a, c, s, b, interpret=not on_gpu()),
        "dense_xla": lambda a, c, s, b, w: a @ w.T,
    }
    return time_against_first(calls, (x, *planes, dense))


def main(argv):
    del argv
    gpu = on_gpu()
    dtype = jnp.bfloat16 if gpu else jnp.float32
    batch = FLAGS.batch or (32 if gpu else 4)
    decode_batches = [int(b) for b in FLAGS.decode_batches or ([32, 128] if gpu else [4])]
    contexts = [int(c) for c in FLAGS.contexts or ([1024, 8192] if gpu else [128])]
    prefill = FLAGS.prefill_len or (4096 if gpu else 64)
    registry = default_registry()
    cpu_kernel = not gpu  # the C++ attention kernel ("cpu") is built and registered before use
    if cpu_kernel:
        try:
            load_paged_attention(Path(EngineOptions().cache_dir) / "cpu_kernels")
        except KernelBuildError as error:
            print(f"the C++ attention kernel is left out: {error}")
            cpu_kernel = False
    bandwidth = memory_bandwidth()
    flops = matmul_rate(8192 if gpu else 1024, dtype)
    print(
        f"device: {jax.devices()[0].device_kind}; memory {bandwidth / 1e9:.0f} GB/s, "
        f"{jnp.dtype(dtype).name} matmul {flops / 1e12:.1f} TFLOP/s"
    )
    rows = []

    def report(shape_name, case, results, work, unit, speedups=None):
        """`speedups`: impl -> its time with the model-dtype cache over this case's."""
        for impl, (seconds, error, wall) in results.items():
            rate = work / seconds
            ceiling = bandwidth if unit == "GB/s" else flops
            scale = 1e9 if unit == "GB/s" else 1e12
            row = dict(
                shape=shape_name,
                case=case,
                impl=impl,
                ms=seconds * 1e3,
                wall_ms=wall * 1e3,
                max_abs_error=error,
                rate=rate / scale,
                unit=unit if unit == "GB/s" else "TFLOP/s",
                percent_of_ceiling=100 * rate / ceiling,
            )
            if speedups and impl in speedups:
                row["speedup_over_model_dtype_cache"] = speedups[impl]
            rows.append(row)
            faster = (
                f"  {speedups[impl]:.2f}x the {dtype.__name__} cache"
                if row.get("speedup_over_model_dtype_cache")
                else ""
            )
            print(
                f"{shape_name:10s} {case:32s} {impl:17s} {row['ms']:9.3f} ms "
                f"(wall {row['wall_ms']:7.3f})  "
                f"err {error:.1e}  {row['rate']:9.2f} {row['unit']:7s} "
                f"({row['percent_of_ceiling']:.0f}% of measured){faster}"
            )

    for shape_name in FLAGS.shapes:
        cfg = shape(shape_name)
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        itemsize = jnp.dtype(dtype).itemsize
        scale = head_dim**-0.5
        impls = runnable(registry.names("attention"), cpu_kernel)

        for requests, context in itertools.product(decode_batches, contexts):
            args = attention_inputs(
                cfg, [1] * requests, [context] * requests, dtype, FLAGS.block_size
            )
            model_dtype = {}  # impl -> seconds with the model-dtype cache
            for kind in FLAGS.kv_cache_dtypes:
                case_args = args
                if kind != "auto":
                    q, kv, *rest = args
                    values, scales = quantize_cache(kv, kind)
                    case_args = (q, values, *rest, scales)
                results = run_case(
                    "attention",
                    impls,
                    registry,
                    decode_call(scale, KVCacheFormat.resolve(kind, dtype).scale_layout),
                    case_args,
                )
                per_token = KVCacheFormat.resolve(kind, dtype).bytes_per_token(
                    1, kv_heads, head_dim
                )
                case = f"decode attn b{requests} c{context}" + (
                    f" {kind}" if kind != "auto" else ""
                )
                speedups = None
                if kind == "auto":
                    model_dtype = {impl: seconds for impl, (seconds, *_) in results.items()}
                elif model_dtype:
                    speedups = {
                        impl: model_dtype[impl] / seconds
                        for impl, (seconds, *_) in results.items()
                        if impl in model_dtype
                    }
                report(shape_name, case, results, requests * context * per_token, "GB/s", speedups)

        args = attention_inputs(cfg, [prefill], [prefill], dtype, FLAGS.block_size)
        results = run_case(
            "attention", impls, registry, lambda f, s=scale: lambda *a: f(*a, sm_scale=s), args
        )
        causal_flops = 4 * heads * head_dim * prefill * (prefill + 1) / 2
        report(shape_name, f"prefill attn {prefill}", results, causal_flops, "TFLOP/s")

        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        keys = jax.random.split(jax.random.key(1), 3)
        gate_up = jax.random.normal(keys[0], (hidden, 2, inter), dtype) * hidden**-0.5
        down = jax.random.normal(keys[1], (inter, hidden), dtype) * inter**-0.5
        for tokens in (batch, prefill):
            x = jax.random.normal(keys[2], (tokens, hidden), dtype)
            results = run_case(
                "ffn",
                runnable(registry.names("ffn"), cpu_kernel),
                registry,
                lambda f: f,
                (x, gate_up, down),
            )
            report(shape_name, f"ffn t{tokens}", results, 6 * tokens * hidden * inter, "TFLOP/s")

        # A MoE layer's experts at the FFN's active size: 64 experts of width I / 8, top 8,
        # routed evenly; the gate/up product over the T * 8 rows sorted by expert.
        experts, top_k, width = 64, 8, max(16, inter // 8)
        expert_w = jax.random.normal(keys[0], (experts, hidden, 2 * width), dtype) * hidden**-0.5
        for tokens in (batch, prefill) if gpu else (batch,):
            routed = tokens * top_k
            sizes = jnp.asarray(np.bincount(np.arange(routed) % experts, minlength=experts))
            x = jax.random.normal(keys[2], (routed, hidden), dtype)
            results = run_case(
                "grouped_matmul",
                runnable(registry.names("grouped_matmul"), cpu_kernel),
                registry,
                lambda f: f,
                (x, expert_w, sizes.astype(jnp.int32)),
            )
            work = 4 * routed * hidden * width
            report(shape_name, f"experts t{tokens}", results, work, "TFLOP/s")

        for fmt in BLOCK_FORMATS:  # the down projection [E, I] in block formats
            raw = random_rows(fmt, hidden, inter, np.random.default_rng(0))
            planes = tuple(map(jnp.asarray, to_planes(fmt, raw)))
            dense = dequantize(*planes).astype(dtype)
            x = jax.random.normal(keys[2], (batch, inter), dtype) * inter**-0.5
            read = sum(plane.nbytes for plane in planes)
            report(shape_name, f"{fmt} down t{batch}", block_case(x, planes, dense), read, "GB/s")

        x = jax.random.normal(keys[2], (batch, hidden), dtype)
        weight = jnp.ones((hidden,), dtype)
        results = run_case(
            "norm",
            runnable(registry.names("norm"), cpu_kernel),
            registry,
            lambda f: lambda a, r, w: f(a, r, w, eps=1e-5),
            (x, x * 0.5, weight),
        )
        report(shape_name, f"add+rmsnorm t{batch}", results, 4 * batch * hidden * itemsize, "GB/s")

    if FLAGS.output_json:
        meta = dict(
            device=jax.devices()[0].device_kind,
            jax=jax.__version__,
            memory_gb_s=bandwidth / 1e9,
            matmul_tflop_s=flops / 1e12,
            dtype=jnp.dtype(dtype).name,
        )
        Path(FLAGS.output_json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    app.run(main)
