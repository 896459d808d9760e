"""A model shape served end to end with random weights (load_format "dummy"): a chat-like
workload through the whole engine, output tokens/s against the decode roofline.

    python -m tools.bench_shape --shape=llama3_8b --num_requests=256     # on a GPU
    python -m tools.bench_shape --shape=smollm2 --num_requests=8 --max_input_len=64 \
        --max_output_len=16 --token_buckets=64,128 --max_num_batched_tokens=128  # a CPU check

The model's folder is written to a temporary directory (config.json of the shape and a small
tokenizer: the prompts are token ids, the outputs are not read as text). Requests arrive at
once with prompt and output lengths drawn uniformly (seeded) between the flags' bounds, greedy,
ignore_eos. Warm-up compiles every bucket first, so the timed run compiles nothing.

The roofline: at the run's mean number of running requests B and mean context C per decode
step, a step must read every weight once and each request's K/V, so it takes at least
(weights + B * C * KV bytes per token) / copy bandwidth, and B over that is the most output
tokens/s decoding can give. Prefill is left out of the bound (the ratio flatters no one:
the run's own prefill time is in its wall time).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.models.shapes import shape
from jaxinfer.sampling_params import RequestOutputKind
from tools.decode import read_bytes
from tools.device_rates import memory_bandwidth
from tools.shape_folder import write_folder

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "llama3_8b", "Model shape (jaxinfer.models.shapes).")
flags.DEFINE_integer("num_requests", 256, "Requests, all submitted at once.")
flags.DEFINE_integer("min_input_len", 128, "Shortest prompt (tokens).")
flags.DEFINE_integer("max_input_len", 1024, "Longest prompt (tokens).")
flags.DEFINE_integer("min_output_len", 64, "Shortest output (tokens).")
flags.DEFINE_integer("max_output_len", 512, "Longest output (tokens).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_json", None, "Also write the result here.")

define_engine_flags()

# What an 8B-shaped run needs beside the engine's defaults (flags override them): few
# buckets (each is a compilation of the whole model), many requests at once.
DEFAULTS = dict(
    load_format="dummy",
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    token_buckets=(128, 256, 512, 1024),
    kv_cache_memory_gb=40.0,
    warmup="all",
)


def main(argv):
    del argv
    cfg = shape(FLAGS.shape)
    rng = np.random.default_rng(FLAGS.seed)
    n = FLAGS.num_requests
    input_lens = rng.integers(FLAGS.min_input_len, FLAGS.max_input_len + 1, n)
    output_lens = rng.integers(FLAGS.min_output_len, FLAGS.max_output_len + 1, n)
    prompts = [rng.integers(3, cfg.vocab_size, size=k).tolist() for k in input_lens]

    with tempfile.TemporaryDirectory() as folder:
        write_folder(Path(folder), cfg)
        start = time.perf_counter()
        options = engine_options_from_flags(defaults=DEFAULTS, model=folder)
        llm = LLM(**dataclasses.asdict(options), use_tqdm=False)
        built = time.perf_counter() - start
    engine = llm.engine
    resolved = engine.describe()
    bandwidth = memory_bandwidth()

    start = time.perf_counter()
    for prompt, k in zip(prompts, output_lens, strict=True):
        params = SamplingParams(
            temperature=0,
            max_tokens=int(k),
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(prompt, params)
    steps = decode_rows = context_sum = 0
    done = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        done += sum(o.finished for o in outputs)
        running = engine.scheduler.running
        steps += 1
        decode_rows += len(running)
        context_sum += sum(r.num_computed_tokens for r in running)
    seconds = time.perf_counter() - start
    assert done == n, f"{done} of {n} requests finished"

    config = engine.config
    arch, cache = config.model.arch, config.cache
    itemsize = np.dtype(config.model.dtype).itemsize
    runner = engine.runner  # every weight but the embedding table (rows of it are read)
    if runner.layer_execution == "scan":
        tree = nnx.to_pure_dict(runner.state)
        weights = read_bytes([tree[k] for k in tree if k not in ("embed", "rope_cache")])
    else:
        top = {k: v for k, v in runner.top_params.items() if k not in ("embed", "rope_cache")}
        weights = read_bytes([runner.layer_params, top])
    kv_per_token = (
        cache.kv_format.bytes_per_block(
            cache.block_size, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim
        )
        / cache.block_size
    )
    mean_batch = decode_rows / steps
    mean_context = context_sum / max(decode_rows, 1)
    roofline_step = (weights + mean_batch * mean_context * kv_per_token) / bandwidth
    row = dict(
        shape=FLAGS.shape,
        device=jax.devices()[0].device_kind,
        requests=n,
        input_tokens=int(input_lens.sum()),
        output_tokens=int(output_lens.sum()),
        seconds=seconds,
        output_tokens_per_s=float(output_lens.sum()) / seconds,
        steps=steps,
        mean_running=mean_batch,
        mean_context=mean_context,
        weights_gb=weights / 1e9,
        memory_gb_s=bandwidth / 1e9,
        roofline_output_tokens_per_s=mean_batch / roofline_step,
        engine_built_s=built,
        dtype=np.dtype(config.model.dtype).name,
        itemsize=itemsize,
    )
    row["percent_of_roofline"] = (
        100 * row["output_tokens_per_s"] / row["roofline_output_tokens_per_s"]
    )
    print(
        f"{FLAGS.shape} ({row['dtype']}, random weights {row['weights_gb']:.2f} GB) on "
        f"{row['device']}: engine built and warmed up in {built:.0f} s\n"
        f"{n} requests, {row['input_tokens']} prompt and {row['output_tokens']} output tokens "
        f"in {seconds:.1f} s: {row['output_tokens_per_s']:.0f} output tokens/s over "
        f"{steps} steps, {mean_batch:.1f} requests running on average at {mean_context:.0f} "
        f"tokens of context\ndecode roofline at that batch and context (copy bandwidth "
        f"{row['memory_gb_s']:.0f} GB/s): {row['roofline_output_tokens_per_s']:.0f} output "
        f"tokens/s; the run reached {row['percent_of_roofline']:.0f}% of it"
    )
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps(dict(row=row, engine=resolved), indent=1))


if __name__ == "__main__":
    app.run(main)
