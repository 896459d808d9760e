"""batch_invariant on this machine's backend, with no checkpoint: a model shape with random
weights (load_format "dummy"), one fixed request run alone and among others.

    python -m tools.invariance_check --shape=smollm2          # on a GPU: the Pallas kernels

The fixed request (greedy, with logprobs) runs alone, then at a random place among 3, 15 and
63 random others (sampled and greedy, other lengths); its tokens and logprobs must be
bit-identical every time with the mode on. The same runs with the mode off are reported beside
them (not asserted: there they may differ, which is what shows the check can see a
difference). Exits 1 if the mode's runs differ.
"""

from __future__ import annotations

import dataclasses
import json
import random
import tempfile
from pathlib import Path

from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.models.shapes import shape
from tools.shape_folder import write_folder

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "smollm2", "Model shape (jaxinfer.models.shapes).")
flags.DEFINE_list("counts", ["3", "15", "63"], "Numbers of other requests beside the fixed one.")
flags.DEFINE_string("output_json", None, "Also write the result here.")

define_engine_flags()

DEFAULTS = dict(
    load_format="dummy",
    max_num_seqs=64,
    max_num_batched_tokens=128,
    token_buckets=(16, 64),
    max_model_len=256,
    num_kv_blocks=2048,
    warmup="all",
)
FIXED = SamplingParams(temperature=0, max_tokens=16, logprobs=3)


def record(output) -> tuple:
    completion = output.outputs[0]
    logprobs = tuple(tuple(sorted(step.items())) for step in completion.logprobs or ())
    return tuple(completion.token_ids), logprobs


def runs(llm: LLM, vocab: int, counts: list[int]) -> list[bool]:
    """Whether the fixed request's record among each count of others equals its own alone."""
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(42)]
    alone = record(llm.generate([prompt], FIXED, use_tqdm=False)[0])
    same = []
    for count in counts:
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 90))] for _ in range(count)
        ]
        others = [
            SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randrange(10**6),
                max_tokens=rng.randrange(1, 40),
            )
            for _ in range(count)
        ]
        where = rng.randrange(count + 1)
        outputs = llm.generate(
            [*prompts[:where], prompt, *prompts[where:]],
            [*others[:where], FIXED, *others[where:]],
            use_tqdm=False,
        )
        same.append(record(outputs[where]) == alone)
    return same


def main(argv):
    del argv
    cfg = shape(FLAGS.shape)
    counts = [int(c) for c in FLAGS.counts]
    result = {}
    with tempfile.TemporaryDirectory() as folder:
        write_folder(Path(folder), cfg)
        for mode in (True, False):
            options = engine_options_from_flags(
                defaults=DEFAULTS, model=folder, batch_invariant=mode
            )
            llm = LLM(**dataclasses.asdict(options), use_tqdm=False)
            resolved = llm.engine.describe()["resolved"]
            kernels = {k: resolved[k]["value"] for k in ("attention", "matmul", "norm", "ffn")}
            same = runs(llm, cfg.vocab_size, counts)
            name = "batch_invariant" if mode else "default"
            result[name] = dict(
                kernels=kernels, identical=dict(zip(FLAGS.counts, same, strict=True))
            )
            print(
                f"{name:15s} kernels {kernels}: identical among {dict(zip(counts, same, strict=True))}"
            )
            del llm
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps(result, indent=1))
    raise SystemExit(0 if all(result["batch_invariant"]["identical"].values()) else 1)


if __name__ == "__main__":
    app.run(main)
