"""The cost of LoRA adapters in a decode step: one batch of requests spread over adapters
against the same batch on the base model alone, side by side in one process.

    python -m tools.bench_lora --batch_size=32 --num_adapters=8 --rank=16

Three engines on one model (the engine flags apply to all): the base model without LoRA;
the same with enable_lora (max_loras = --num_adapters, max_lora_rank = --rank) running the
batch's requests on the base model; and that engine with the requests spread round-robin
over --num_adapters random adapters of rank --rank on every target (q, k, v, o, gate, up,
down), written in PEFT's format. Each engine prefills the batch, then runs --steps decode
steps, timed; the engines take turns for --rounds and the median step time of each is
reported, with its ratio to the base model's. Adapter loading is timed on its own (the
first admission of each adapter into a slot).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from jaxinfer import LoRARequest, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.layers.lora import target_shapes

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 32, "Requests in the batch.")
flags.DEFINE_integer("num_adapters", 8, "Adapters the requests are spread over.")
flags.DEFINE_integer("rank", 16, "The adapters' rank.")
flags.DEFINE_integer("steps", 32, "Decode steps timed per round.")
flags.DEFINE_integer("rounds", 5, "Rounds of each engine in turn; medians reported.")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens of each request.")
define_engine_flags()


def write_adapter(folder: Path, arch, rank: int, seed: int) -> Path:
    """A random adapter of every target in PEFT's files (as peft's save_pretrained writes)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for target, (inputs, outputs) in target_shapes(arch).items():
            part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, inputs**-0.5, (rank, inputs))
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.01, (outputs, rank))
    save_file(
        {k: v.astype(np.float32) for k, v in tensors.items()}, folder / "adapter_model.safetensors"
    )
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(target_shapes(arch)),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def decode_step_seconds(engine: LLMEngine, loras, steps: int, prompt_len: int) -> float:
    """Median seconds of a decode step of the batch (every request prefilled first)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = engine.config.model.arch.vocab_size
    for lora in loras:
        engine.add_request(
            rng.integers(100, vocab - 100, prompt_len).tolist(), params, lora_request=lora
        )
    while any(
        r.num_output_tokens == 0 for r in engine.scheduler.waiting + engine.scheduler.running
    ):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main(argv):
    del argv
    options = engine_options_from_flags()
    base = LLMEngine(options)
    lora_options = {
        "enable_lora": True,
        "max_loras": FLAGS.num_adapters,
        "max_lora_rank": FLAGS.rank,
    }
    with_lora = LLMEngine(dataclasses.replace(options, **lora_options))
    arch = base.config.model.arch
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(folder / f"a{i}", arch, FLAGS.rank, i)))
        for i in range(FLAGS.num_adapters)
    ]
    start = time.perf_counter()
    for adapter in adapters:
        with_lora.loras.get(adapter)
    read = time.perf_counter() - start
    spread = [adapters[i % len(adapters)] for i in range(FLAGS.batch_size)]
    runs = {
        "base model, no LoRA": (base, [None] * FLAGS.batch_size),
        "enable_lora, base requests": (with_lora, [None] * FLAGS.batch_size),
        f"{FLAGS.num_adapters} adapters of rank {FLAGS.rank}": (with_lora, spread),
    }
    times = {name: [] for name in runs}
    for round_index in range(FLAGS.rounds + 1):
        for name, (engine, loras) in runs.items():
            seconds = decode_step_seconds(engine, loras, FLAGS.steps, FLAGS.prompt_len)
            if round_index:  # the first round compiles and loads
                times[name].append(seconds)
    reference = statistics.median(times["base model, no LoRA"])
    print(f"batch {FLAGS.batch_size}, {FLAGS.steps} decode steps a round, {FLAGS.rounds} rounds")
    print(f"reading {len(adapters)} adapters (PEFT files -> device): {read:.2f} s in all")
    print(f"slot loads: {with_lora.loras.slots.num_loads}")
    for name, values in times.items():
        median = statistics.median(values)
        spread_ms = ", ".join(f"{v * 1e3:.1f}" for v in values)
        print(f"{name:32s} {median * 1e3:7.2f} ms/step  {median / reference:5.2f}x  ({spread_ms})")


if __name__ == "__main__":
    app.run(main)
