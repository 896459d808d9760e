"""A hybrid model's decode step against the same model with attention in every layer, as the
context grows.

    python -m tools.bench_hybrid --contexts=1024,8192,32768 --batch_size=1

Three tiny random models of one shape, written by transformers (Qwen3_5ForCausalLM) into a
temporary folder and loaded by the engine's own loader and runner (its resolved kernels):
- "hybrid": Qwen3.5's layout, three Gated DeltaNet layers then one attention layer, repeated;
- "attention": every layer attention (the same model otherwise);
- "linear": every layer Gated DeltaNet, so its step is the linear layers' cost alone.
Each is timed on a decode step (one new token per request) whose requests hold `context`
tokens in the KV cache; the report gives the step times, each model's growth from the first
context to the last, and the hybrid's step against the all-attention one's at each context.
The cache contents are zeros and the linear layers' states whatever the slots hold: the cost
of a step does not depend on them.

--write_model=FOLDER only writes the hybrid model there, for other tools to run (prefix
caching on a hybrid, tools.bench_throughput):

    python -m tools.bench_hybrid --write_model=/tmp/hybrid --hidden_size=512 --contexts=2048
    python -m tools.bench_throughput --model=/tmp/hybrid --num_requests=32 \
        --shared_prefix_len=1024 --min_output_len=16 --max_output_len=32 --compare_prefix_caching
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
from jaxinfer.config.configure import configure
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.model_loader.load import load_model
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.parallel.sharding import Partitioner
from tools.decode import decode_batch, seconds_per_forward

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["1024", "8192", "32768"], "Tokens of context per request.")
flags.DEFINE_integer("batch_size", 1, "Requests in the decode step.")
flags.DEFINE_integer("steps", 20, "Timed steps per point (after two warm-up steps).")
flags.DEFINE_integer("layers", 8, "Layers of each model (a multiple of 4).")
flags.DEFINE_integer("hidden_size", 256, "The models' hidden size.")
flags.DEFINE_string("output_json", None, "Also write the rows here.")
flags.DEFINE_string("write_model", None, "Only write the hybrid model into this folder.")

BLOCK_SIZE = 16
LINEAR, FULL = "linear_attention", "full_attention"


def write_model(folder: Path, layer_types: list[str], max_context: int) -> Path:
    import torch
    import transformers

    from tools.tiny_tokenizer import write_tiny_tokenizer

    hidden = FLAGS.hidden_size
    config = transformers.Qwen3_5TextConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=max_context + 64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).eval().save_pretrained(folder)
    write_tiny_tokenizer(folder, config.vocab_size)
    return folder


def step_times(folder: Path, contexts: list[int], batch_size: int) -> tuple[list[float], dict]:
    """Seconds per decode step at each context, and the resolved kernels."""
    blocks = batch_size * -(-max(contexts) // BLOCK_SIZE)
    options = EngineOptions(
        model=str(folder),
        block_size=BLOCK_SIZE,
        num_kv_blocks=blocks + 1,
        max_num_seqs=batch_size,
        max_model_len=max(contexts) + 1,
        max_num_batched_tokens=max(batch_size, 16),
        token_buckets=(max(batch_size, 16),),
    )
    config, kernels = configure(options, folder)
    partitioner = Partitioner(make_mesh(1))
    graphdef, state, _ = load_model(folder, config, partitioner)
    runner = ModelRunner(config, graphdef, state, kernels, partitioner, sampling=False)
    vocab = config.model.arch.vocab_size
    times = []
    for context in contexts:
        batch = decode_batch(batch_size, context, BLOCK_SIZE, vocab, blocks // batch_size)
        batch = jax.device_put(_with_rows(batch, batch_size))
        times.append(seconds_per_forward(runner, batch, FLAGS.steps))
    resolved = config.resolved
    return times, {"attention": resolved.attention, "gated_delta": resolved.gated_delta}


def _with_rows(batch, batch_size: int):
    """The decode batch with each request's state slot (its row)."""
    return dataclasses.replace(batch, state_rows=np.arange(batch_size, dtype=np.int32))


def main(argv):
    del argv
    contexts = [int(c) for c in FLAGS.contexts]
    period = FLAGS.layers // 4
    if FLAGS.write_model:
        write_model(Path(FLAGS.write_model), [LINEAR, LINEAR, LINEAR, FULL] * period, max(contexts))
        return
    models = {
        "hybrid": [LINEAR, LINEAR, LINEAR, FULL] * period,
        "attention": [FULL] * FLAGS.layers,
        "linear": [LINEAR] * FLAGS.layers,
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layer_types in models.items():
            folder = write_model(Path(tmp) / name, layer_types, max(contexts))
            times, kernels = step_times(folder, contexts, FLAGS.batch_size)
            rows[name] = times
            shown = ", ".join(
                f"{c}: {t * 1e3:.2f} ms" for c, t in zip(contexts, times, strict=True)
            )
            print(
                f"{name:9s} ({FLAGS.layers} layers, kernels {kernels}): {shown}; "
                f"{contexts[-1]} / {contexts[0]}: {times[-1] / times[0]:.2f}x",
                flush=True,
            )
    ratios = [h / a for h, a in zip(rows["hybrid"], rows["attention"], strict=True)]
    print(
        "hybrid / attention step: "
        + ", ".join(f"{c}: {r:.2f}x" for c, r in zip(contexts, ratios, strict=True))
    )
    if FLAGS.output_json:
        report = {
            "contexts": contexts,
            "batch_size": FLAGS.batch_size,
            "step_seconds": rows,
            "hybrid_over_attention": ratios,
        }
        Path(FLAGS.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    app.run(main)
