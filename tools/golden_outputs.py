"""Greedy outputs and logprobs of the default model on a fixed prompt set, under several
engine configurations, written to a JSON file or compared bit for bit with one written before.

A refactor that must not change behaviour runs it before (--write) and after (--check):

    python -m tools.golden_outputs --write=/tmp/golden.json
    python -m tools.golden_outputs --check=/tmp/golden.json

Floats are compared exactly (as their float32 bit patterns). The file is specific to the
machine's CPU (its vector instructions change float32 sums), so it is not committed.
"""

from __future__ import annotations

import json
import struct
import sys

from absl import app, flags

from jaxinfer import LLM, SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_string("write", None, "Write the outputs to this JSON file.")
flags.DEFINE_string("check", None, "Compare the outputs with this JSON file.")
flags.DEFINE_list("configs", [], "Names of the configurations to run (default: all).")

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
    "Translate 'good morning' into Spanish:",
]

# name -> engine options on top of the defaults (each exercises another weight path)
CONFIGS = {
    "default": {},
    "int8": {"quantization": "int8"},
    "xla_out_in": {"matmul_impl": "xla"},
    "in_out_reference": {
        "matmul_impl": "xla",
        "weight_layout": "in_out",
        "attention_impl": "reference",
    },
    "scan_no_gguf": {"layer_execution": "scan", "gguf_weights": "off"},
}


def _bits(x: float) -> str:
    return struct.pack(">f", x).hex()


def _record(output) -> dict:
    completion = output.outputs[0]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [{str(k): _bits(v) for k, v in step.items()} for step in completion.logprobs],
        "prompt_logprobs": [
            None if step is None else {str(k): _bits(v) for k, v in step.items()}
            for step in output.prompt_logprobs
        ],
    }


def run_config(options: dict) -> dict:
    llm = LLM(max_num_seqs=8, max_num_batched_tokens=64, **options)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3, prompt_logprobs=2)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # 1-row steps (GGUF blocks)
    return {"batch": [_record(o) for o in together], "alone": _record(alone[0])}


def main(argv):
    del argv
    if (FLAGS.write is None) == (FLAGS.check is None):
        sys.exit("give one of --write or --check")
    names = FLAGS.configs or list(CONFIGS)
    results = {}
    for name in names:
        results[name] = run_config(CONFIGS[name])
        print(f"{name}: done", flush=True)
    if FLAGS.write:
        with open(FLAGS.write, "w") as f:
            json.dump(results, f)
        return
    with open(FLAGS.check) as f:
        expected = json.load(f)
    failed = [name for name in names if results[name] != expected[name]]
    for name in names:
        print(f"{name}: {'DIFFERENT' if name in failed else 'bit-identical'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    app.run(main)
