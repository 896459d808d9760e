"""DeepSeek-V4's compressed attention against the same model with every layer dense, as the
context grows: the decode step's time and the KV cache a request holds.

    python -m tools.bench_compressed --contexts=1024,8192,65536

Two tiny random models of one shape, written by transformers (DeepseekV4ForCausalLM) into a
temporary folder and run by the engine's own loader and runner:
- "compressed": V4's layout, two heavily compressed layers (one entry per 128 tokens, all
  read) then compressed sparse ones (one entry per 4 tokens, the indexer's top-k read) and
  heavily compressed ones alternating, each beside a 128-token sliding window;
- "dense": every layer attending to every position (a sliding window as long as the
  longest context; the same model otherwise).
Each is timed on a decode step (one new token per request) whose requests hold `context`
tokens, with each kernel implementation of --impls (`--impls=reference,cpu`: the pure-JAX
references against the C++ kernels), their engines taking turns for --rounds; the cache
contents are zeros (a step's cost does not depend on them). The KV bytes
a request holds at each context come from the cache specs the engine allocates by
(jaxinfer.config.cache_specs): the window's blocks, each kind's entries, the compressors'
states.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from jaxinfer.config import EngineOptions
from jaxinfer.config.cache_specs import describe_spec
from jaxinfer.config.configure import configure
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.layers.compressed_cache import entry_columns
from jaxinfer.model_loader.load import load_model
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.parallel.sharding import Partitioner
from tools.decode import decode_batch, seconds_per_forward

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["1024", "8192", "65536"], "Tokens of context per request.")
flags.DEFINE_integer("steps", 30, "Timed steps per point and round (after two warm-up steps).")
flags.DEFINE_integer("rounds", 3, "Rounds of the implementations in turn; medians reported.")
flags.DEFINE_integer("layers", 8, "Layers of each model.")
flags.DEFINE_integer("hidden_size", 256, "The models' hidden size.")
flags.DEFINE_list(
    "impls",
    ["auto"],
    "compressed_attention_impl values to time each model with (reference, cpu, auto), side by "
    "side in one run.",
)
flags.DEFINE_string("output_json", None, "Also write the rows here.")

BLOCK_SIZE = 16
WINDOW = 128
HCA, CSA, SLIDING = (
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "sliding_attention",
)


def write_model(folder: Path, layer_types: list[str], window: int, max_context: int) -> Path:
    import torch
    import transformers

    from tools.tiny_tokenizer import write_tiny_tokenizer

    hidden = FLAGS.hidden_size
    config = transformers.DeepseekV4Config(
        vocab_size=1024,
        hidden_size=hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=8,
        head_dim=64,
        partial_rotary_factor=0.5,
        q_lora_rank=hidden // 2,
        o_groups=2,
        o_lora_rank=hidden // 2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=128,
        compress_rates={CSA: 4, HCA: 128},
        sliding_window=window,
        max_position_embeddings=max_context + 64,
    )
    torch.manual_seed(0)
    transformers.DeepseekV4ForCausalLM(config).eval().save_pretrained(folder)
    write_tiny_tokenizer(folder, config.vocab_size)
    return folder


def held_bytes(groups: list[dict], context: int) -> int:
    """Bytes one request's cache holds at `context` tokens, from the groups describe()
    reports (jaxinfer.config.cache_specs.describe_spec): its blocks of the window (all its
    blocks without one), each kind's entries, its compressor states."""
    total = 0
    for group in groups:
        if group["kind"] == "compressed_entries":
            total += context // group["ratio"] * group["ratio"] * group["bytes_per_token"]
        elif "bytes_per_token" in group:
            window = group["sliding_window"]
            kept = context if window is None else min(context, window)
            total += (-(-kept // BLOCK_SIZE) + 1) * BLOCK_SIZE * group["bytes_per_token"]
        else:
            total += group["bytes_per_request"]
    return int(total)


def measure(folder: Path, context: int, impls: list[str]) -> tuple[list[float], int]:
    """Seconds per decode step at `context` with each of `impls` (the median over --rounds,
    the implementations' engines taking turns), and the bytes the request holds. The engine
    is sized for that context (max_model_len): the pure-JAX references' shapes, and so their
    cost, follow the longest context a request may reach."""
    blocks = -(-context // BLOCK_SIZE)
    runners = []
    for impl in impls:
        options = EngineOptions(
            model=str(folder),
            block_size=BLOCK_SIZE,
            num_kv_blocks=blocks + 2,
            max_num_seqs=1,
            max_model_len=context,
            max_num_batched_tokens=16,
            token_buckets=(16,),
            enable_prefix_caching=False,
            compressed_attention_impl=impl,
        )
        config, kernels = configure(options, folder)
        partitioner = Partitioner(make_mesh(1))
        graphdef, state, _ = load_model(folder, config, partitioner)
        runners.append(ModelRunner(config, graphdef, state, kernels, partitioner, sampling=False))
    arch = config.model.arch
    batch = decode_batch(1, context, BLOCK_SIZE, arch.vocab_size, blocks)
    # the block-table row's entry columns: each kind's entries on blocks 1..
    row = np.zeros((1, config.block_table_width), np.int32)
    row[:, :blocks] = batch.block_tables
    for _, start, end in entry_columns(arch, BLOCK_SIZE, config.model.max_model_len):
        row[:, start:end] = 1 + np.arange(end - start)
    batch = dataclasses.replace(batch, block_tables=row, state_rows=np.zeros(1, np.int32))
    batch = jax.device_put(batch)
    times = [
        [seconds_per_forward(r, batch, FLAGS.steps) for r in runners] for _ in range(FLAGS.rounds)
    ]
    groups = [
        describe_spec(spec, arch, config.cache.kv_format, dict(config.cache.entry_blocks))
        for spec in config.cache.layer_specs
    ]
    return [float(np.median(t)) for t in zip(*times, strict=True)], held_bytes(groups, context)


def layout(layers: int) -> list[str]:
    """HF's default V4 layout: two heavily compressed layers, then CSA and HCA alternating."""
    return [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(layers - 2)]


def main(argv):
    del argv
    contexts = [int(c) for c in FLAGS.contexts]
    models = {
        "compressed": (layout(FLAGS.layers), WINDOW),
        "dense": ([SLIDING] * FLAGS.layers, max(contexts) + 1),
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (layer_types, window) in models.items():
            folder = write_model(Path(tmp) / name, layer_types, window, max(contexts))
            measured = [measure(folder, c, FLAGS.impls) for c in contexts]
            for index, impl in enumerate(FLAGS.impls):
                times = [m[0][index] for m in measured]
                held = [m[1] for m in measured]
                rows[f"{name}[{impl}]"] = {"step_seconds": times, "kv_bytes": held}
                shown = ", ".join(
                    f"{c}: {t * 1e3:.2f} ms, {b / 2**20:.2f} MiB"
                    for c, t, b in zip(contexts, times, held, strict=True)
                )
                print(f"{name}[{impl}]: {shown}", flush=True)

    def ratios(over: str, under: str, what: str) -> str:
        pairs = zip(rows[over][what], rows[under][what], strict=True)
        values = [a / b for a, b in pairs]
        return ", ".join(f"{c}: {r:.3f}x" for c, r in zip(contexts, values, strict=True))

    for impl in FLAGS.impls:
        for what in ("step_seconds", "kv_bytes"):
            print(f"compressed / dense {what} [{impl}]: " + ratios(
                f"compressed[{impl}]", f"dense[{impl}]", what))  # fmt: skip
    for name in models:
        for impl in FLAGS.impls[1:]:
            print(f"{name} step_seconds, {impl} / {FLAGS.impls[0]}: " + ratios(
                f"{name}[{impl}]", f"{name}[{FLAGS.impls[0]}]", "step_seconds"))  # fmt: skip
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps({"contexts": contexts, **rows}, indent=2))


if __name__ == "__main__":
    app.run(main)
