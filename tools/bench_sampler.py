"""The sampler's cost, and what structured outputs cost per step, on the default model.

    python -m tools.bench_sampler

1. The jitted sampler alone on random logits of the default model's vocabulary, 64 rows:
   all greedy, all random (temperature only), and mixed (temperature, top-k, top-p, min_p,
   the three penalties, logit bias); median of repeated calls, same process.
2. The engine on 16 chat requests generating JSON under a schema against the same requests
   unconstrained (greedy, the same number of tokens each, ignore_eos for the unconstrained
   ones): time per step.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.execution.batch import SamplingMetadata
from jaxinfer.engine.sampling.constraints import bitmask_width
from jaxinfer.engine.sampling.sampler import SamplerState, sample
from jaxinfer.sampling_params import StructuredOutputsParams

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 64, "Requests in the sampler benchmark.")
flags.DEFINE_integer("repeats", 20, "Timed calls per variant.")
flags.DEFINE_integer("structured_requests", 16, "Requests in the structured-output run.")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


def metadata(rows: int, mixed: bool, greedy: bool) -> SamplingMetadata:
    rng = np.random.default_rng(0)
    index = np.arange(rows)
    neutral = SamplingMetadata.neutral(rows)
    if greedy:
        return neutral
    return dataclasses.replace(
        neutral,
        temperature=np.where(index % 4 == 0, 0.0, 0.8).astype(np.float32),
        top_k=np.where(mixed & (index % 3 == 0), 40, 0).astype(np.int32),
        top_p=np.where(mixed & (index % 3 == 1), 0.9, 1.0).astype(np.float32),
        min_p=np.where(mixed & (index % 5 == 0), 0.05, 0.0).astype(np.float32),
        repetition_penalty=np.where(mixed & (index % 2 == 0), 1.2, 1.0).astype(np.float32),
        presence_penalty=np.where(mixed & (index % 2 == 1), 0.5, 0.0).astype(np.float32),
        frequency_penalty=np.where(mixed & (index % 2 == 1), 0.3, 0.0).astype(np.float32),
        has_bias=np.where(mixed & (index % 7 == 0), 1, 0).astype(np.int32),
        seeds=rng.integers(0, 2**32, size=(rows, 2), dtype=np.uint32),
        output_positions=index.astype(np.int32),
        keeps=np.ones(rows, np.int32),
    )


def bench_sampler(vocab: int) -> None:
    rows = FLAGS.rows
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 4)
    state = SamplerState(
        output_counts=jnp.asarray(rng.integers(0, 2, size=(rows + 1, vocab)), jnp.int32),
        prompt_mask=jnp.asarray(rng.random((rows + 1, vocab)) < 0.01),
        bias=jnp.zeros((rows + 1, vocab), jnp.float32),
        bitmask=jnp.full((rows + 1, bitmask_width(vocab)), -1, jnp.int32),
    )
    slots = jnp.arange(rows, dtype=jnp.int32)
    variants = {
        "all greedy": metadata(rows, mixed=False, greedy=True),
        "temperature only": metadata(rows, mixed=False, greedy=False),
        "mixed": metadata(rows, mixed=True, greedy=False),
    }
    times = {}
    for name, md in variants.items():
        md = jax.device_put(md)
        jax.block_until_ready(sample(logits, md, state, slots))
        samples = []
        for _ in range(FLAGS.repeats):
            start = time.perf_counter()
            jax.block_until_ready(sample(logits, md, state, slots))
            samples.append(time.perf_counter() - start)
        times[name] = float(np.median(samples))
    base = times["all greedy"]
    for name, value in times.items():
        print(f"sampler, {rows} rows, {name}: {value * 1e3:.2f} ms ({value / base:.2f}x greedy)")


def bench_structured(llm: LLM) -> None:
    tokenizer = llm.tokenizer
    engine = llm.engine
    conversations = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}]
        for i in range(FLAGS.structured_requests)
    ]
    prompts = [tokenizer.apply_chat_template(c) for c in conversations]
    constrained = SamplingParams(
        temperature=0,
        max_tokens=96,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )

    def timed(params_list):
        steps = 0
        start = time.perf_counter()
        for text, params in zip(prompts, params_list, strict=True):
            engine.add_request(tokenizer.encode(text, add_special_tokens=False), params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
            steps += 1
        return time.perf_counter() - start, steps, outputs

    engine.reset_prefix_cache()
    structured_time, structured_steps, outputs = timed([constrained] * len(prompts))
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    engine.reset_prefix_cache()
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    plain_time, plain_steps, _ = timed(plain)
    per_structured = structured_time / structured_steps
    per_plain = plain_time / plain_steps
    print(
        f"engine, {len(prompts)} requests, {sum(lengths)} tokens: structured (JSON schema) "
        f"{structured_time:.2f} s over {structured_steps} steps ({per_structured * 1e3:.1f} ms/step)"
        f", unconstrained {plain_time:.2f} s over {plain_steps} steps "
        f"({per_plain * 1e3:.1f} ms/step); ratio {per_structured / per_plain:.2f}x per step"
    )


def main(argv):
    del argv
    llm = LLM(max_num_seqs=FLAGS.rows)
    bench_sampler(llm.engine.config.model.arch.vocab_size)
    if FLAGS.structured_requests:
        bench_structured(llm)


if __name__ == "__main__":
    app.run(main)
