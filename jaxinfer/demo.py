"""A generation demo on the default model: `python -m jaxinfer.demo` (or `make demo`).

Prints the completions of a few chat prompts, generated together with continuous batching.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags

FLAGS = flags.FLAGS
define_engine_flags()
flags.DEFINE_integer("max_tokens", 96, "Most tokens per completion.")
flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
flags.DEFINE_integer("seed", None, "Seed for sampled (temperature > 0) completions.")

QUESTIONS = [
    "Why is the sky blue?",
    "Give me three tips for writing clear code.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
]


def main(argv):
    del argv
    start = time.perf_counter()
    options = engine_options_from_flags()
    llm = LLM(**dataclasses.asdict(options))
    engine = llm.engine
    print(
        f"loaded {engine.config.model.path} in {time.perf_counter() - start:.1f} s "
        f"(warm-up {engine.warmup_seconds:.1f} s, token buckets "
        f"{list(engine.config.scheduler.token_buckets)})"
    )
    params = SamplingParams(
        temperature=FLAGS.temperature, max_tokens=FLAGS.max_tokens, seed=FLAGS.seed
    )
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    elapsed = time.perf_counter() - start
    generated = 0
    for question, output in zip(QUESTIONS, outputs, strict=True):
        completion = output.outputs[0]
        generated += len(completion.token_ids)
        print(f"\n### {question}\n{completion.text.strip()}\n[{completion.finish_reason}]")
    print(f"\n{generated} tokens in {elapsed:.1f} s ({generated / elapsed:.1f} tokens/s)")


if __name__ == "__main__":
    app.run(main)
