"""End-to-end decode-step time of a random-weight model against its memory roofline.

    python -m tools.decode_roofline --shape=llama3_8b --batch_sizes=1,32,128 --context=1024

Builds the model of a named shape (jaxinfer.models.shapes) with random weights on the device,
a KV cache holding --context tokens for every request, and times the jitted step (all layers
under scan, the LM head on one row per request) on a decode batch: one new token per request.
The roofline is the bytes a decode step must read (every weight once, plus each request's K/V)
over the measured device-to-device copy bandwidth; the report gives the step time, that bound
and their ratio. No checkpoint or tokenizer is needed. Kernels, dtype and weight layout are the
engine's, resolved from the engine flags (--attention_impl, --dtype, ...).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.config.platform import Platform
from jaxinfer.config.resolve import resolve
from jaxinfer.layers.kernel_registry import default_registry
from jaxinfer.layers.kv_cache import KVCache
from jaxinfer.models.llama import build_llama
from jaxinfer.models.params import head_name, random_params
from jaxinfer.models.shapes import shape
from tools.decode import decode_batch, read_bytes
from tools.device_profile import format_kernel_times, kernel_times
from tools.device_rates import memory_bandwidth

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "llama3_8b", "Model shape (jaxinfer.models.shapes).")
flags.DEFINE_list("batch_sizes", ["1", "32", "128"], "Decode batch sizes.")
flags.DEFINE_integer("context", 1024, "Tokens in each request's context (the new one included).")
flags.DEFINE_integer("steps", 10, "Timed steps per batch size (after two warm-up steps).")
flags.DEFINE_list(
    "profile_batch_sizes",
    [],
    "Batch sizes whose step is also profiled: device time per kernel (tools.device_profile).",
)
flags.DEFINE_string("output_json", None, "Also write the rows here.")


define_engine_flags()


def main(argv):
    del argv
    cfg = shape(FLAGS.shape)
    options = engine_options_from_flags()
    resolution = resolve(
        options, Platform.detect(options.cache_dir), cfg, default_registry(), gguf_source=None
    )
    kernels, resolved = resolution.kernels, resolution.options
    dtype = resolved.jnp_dtype
    batch_sizes = [int(b) for b in FLAGS.batch_sizes]
    block_size, context = options.block_size, FLAGS.context
    bandwidth = memory_bandwidth()

    start = time.perf_counter()
    params = random_params(cfg, dtype, on_device=True)
    graphdef, state = build_llama(
        cfg, params, dtype, weight_layout=kernels.weight_layout, quantization=options.quantization
    )
    del params
    tree = nnx.to_pure_dict(state)  # all but the embedding table (B rows of it are read)
    weights = read_bytes([tree["layers"], tree["norm"], tree[head_name(cfg)]])
    num_blocks = 1 + max(batch_sizes) * -(-context // block_size)
    kv_shape = (
        cfg.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    kv_cache = KVCache(jax.random.normal(jax.random.key(1), kv_shape, dtype))
    print(
        f"{FLAGS.shape} ({jnp.dtype(dtype).name}) on {jax.devices()[0].device_kind}: weights "
        f"{weights / 1e9:.2f} GB, KV cache {kv_cache.values.nbytes / 1e9:.2f} GB, built in "
        f"{time.perf_counter() - start:.1f} s; memory bandwidth {bandwidth / 1e9:.0f} GB/s; "
        f"kernels {resolved.attention}/{resolved.ffn}/{resolved.norm}/{resolved.matmul}"
    )

    def step(state, kv_cache, batch):
        return nnx.merge(graphdef, state)(kv_cache, batch, kernels=kernels)

    step = jax.jit(step, donate_argnames=("kv_cache",))
    rows = []
    for batch_size in batch_sizes:
        batch = jax.device_put(decode_batch(batch_size, context, block_size, cfg.vocab_size))
        for _ in range(2):
            kv_cache, logits = step(state, kv_cache, batch)
        logits.block_until_ready()
        begin = time.perf_counter()
        for _ in range(FLAGS.steps):
            kv_cache, logits = step(state, kv_cache, batch)
        logits.block_until_ready()
        seconds = (time.perf_counter() - begin) / FLAGS.steps
        kv_bytes = (
            batch_size
            * context
            * cfg.num_hidden_layers
            * 2
            * cfg.num_key_value_heads
            * cfg.head_dim
            * jnp.dtype(dtype).itemsize
        )
        roofline = (weights + kv_bytes) / bandwidth
        row = dict(
            shape=FLAGS.shape,
            batch=batch_size,
            context=context,
            step_ms=seconds * 1e3,
            roofline_ms=roofline * 1e3,
            percent_of_roofline=100 * roofline / seconds,
            tokens_per_s=batch_size / seconds,
        )
        rows.append(row)
        print(
            f"batch {batch_size:4d}: step {row['step_ms']:8.2f} ms, roofline "
            f"{row['roofline_ms']:7.2f} ms ({row['percent_of_roofline']:.0f}%), "
            f"{row['tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
        if str(batch_size) in FLAGS.profile_batch_sizes:
            cache = [kv_cache]  # donated by each step, so each takes the last one's

            def one_step(cache=cache, batch=batch):
                cache[0], logits = step(state, cache[0], batch)
                return logits

            row["kernels"] = kernel_times(one_step)
            kv_cache = cache[0]
            print(format_kernel_times(row["kernels"]), flush=True)
    if FLAGS.output_json:
        meta = dict(
            device=jax.devices()[0].device_kind,
            jax=jax.__version__,
            memory_gb_s=bandwidth / 1e9,
            weights_gb=weights / 1e9,
            dtype=jnp.dtype(dtype).name,
            resolved={k: v["value"] for k, v in resolved.describe().items()},
        )
        Path(FLAGS.output_json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    app.run(main)
