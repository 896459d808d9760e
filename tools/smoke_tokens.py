"""The default model's greedy tokens on this machine against the CPU engine's, which ship in
the repository (tools/data/cpu_tokens.json), for a first run on a new backend (gpu_smoke.sh).

    python -m tools.smoke_tokens --write=tools/data/cpu_tokens.json      # on CPU, once
    python -m tools.smoke_tokens --check=tools/data/cpu_tokens.json \\
        --model=/path/SmolLM2-135M-Instruct.Q4_1.gguf --output_json=tokens.json

The other engine flags (dtype, kernels, cache_dir, ...) apply; every option left unset is
"auto", as a user would run it. The check runs two things per prompt:
- free-running greedy generation, reporting how many leading tokens equal the CPU's;
- the CPU's continuation scored as a prompt (prompt logprobs), which tells a real difference
  from a near-tie flipped by rounding: at every position the CPU's token must be within
  --tolerance nats of this engine's top token, and its logprob within --tolerance of the CPU's.
Exits 1 when a prompt fails either bound (or the prompts tokenize differently: another model).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.model_loader.model_cache import file_sha256, source_gguf

FLAGS = flags.FLAGS
define_engine_flags()
flags.DEFINE_string("write", None, "Write this engine's tokens to this JSON file.")
flags.DEFINE_string("check", None, "Compare this engine's tokens with this JSON file.")
flags.DEFINE_float(
    "tolerance", 0.5, "Nats allowed: near-tie gap and logprob difference (bf16 vs float32)."
)
flags.DEFINE_string("output_json", None, "With --check: write the comparison here.")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 16
# A small engine: the smoke run compiles only what 4 short prompts need.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)


def _engine() -> LLM:
    options = engine_options_from_flags(defaults=SMALL)  # SMALL where no flag says otherwise
    llm = LLM(**dataclasses.asdict(options))
    print(json.dumps(llm.engine.describe(), indent=1), flush=True)
    return llm


def _model_sha256(llm: LLM) -> str | None:
    """The digest of the GGUF file the model came from, where it came from one."""
    path = source_gguf(FLAGS.model, Path(llm.engine.config.model.path))
    return None if path is None else file_sha256(path)


def generate(llm: LLM) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    records = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        records.append(
            dict(
                prompt_token_ids=list(output.prompt_token_ids),
                token_ids=tokens,
                logprobs=[step[t] for step, t in zip(completion.logprobs, tokens, strict=True)],
            )
        )
    return records


def score(llm: LLM, expected: list[dict]) -> list[dict]:
    """Per expected record, per continuation token: (this engine's logprob of it, its top
    logprob), with the continuation fed as a prompt."""
    prompts = [r["prompt_token_ids"] + r["token_ids"] for r in expected]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scored = []
    for record, output in zip(expected, outputs, strict=True):
        start = len(record["prompt_token_ids"])
        steps = output.prompt_logprobs[start:]
        scored.append(
            dict(
                logprobs=[step[t] for step, t in zip(steps, record["token_ids"], strict=True)],
                top_logprobs=[max(step.values()) for step in steps],
            )
        )
    return scored


def compare(expected: list[dict], got: list[dict], scored: list[dict], tolerance: float):
    rows = []
    for want, have, marks in zip(expected, got, scored, strict=True):
        same = 0
        while same < len(want["token_ids"]) and have["token_ids"][same] == want["token_ids"][same]:
            same += 1
        gap = max(t - lp for t, lp in zip(marks["top_logprobs"], marks["logprobs"], strict=True))
        drift = max(abs(a - b) for a, b in zip(marks["logprobs"], want["logprobs"], strict=True))
        tokenized_alike = have["prompt_token_ids"] == want["prompt_token_ids"]
        rows.append(
            dict(
                matching_tokens=same,
                of=len(want["token_ids"]),
                max_near_tie_gap=gap,
                max_logprob_difference=drift,
                tokenized_alike=tokenized_alike,
                passed=tokenized_alike and gap <= tolerance and drift <= tolerance,
                token_ids=have["token_ids"],
            )
        )
    return rows


def main(argv):
    del argv
    if (FLAGS.write is None) == (FLAGS.check is None):
        raise SystemExit("give one of --write or --check")
    llm = _engine()
    records = generate(llm)
    if FLAGS.write:
        engine = llm.engine.describe()
        document = dict(
            prompts=PROMPTS,
            max_tokens=MAX_TOKENS,
            engine=engine["resolved"],
            model_sha256=_model_sha256(llm),
            outputs=records,
        )
        Path(FLAGS.write).write_text(json.dumps(document, indent=1) + "\n")
        return
    expected = json.loads(Path(FLAGS.check).read_text())
    if expected["prompts"] != PROMPTS or expected["max_tokens"] != MAX_TOKENS:
        raise SystemExit(f"{FLAGS.check} was written for other prompts: write it again")
    sha = _model_sha256(llm)
    if None not in (sha, expected["model_sha256"]) and sha != expected["model_sha256"]:
        raise SystemExit(f"{FLAGS.check} was written for another model ({sha} here)")
    rows = compare(expected["outputs"], records, score(llm, expected["outputs"]), FLAGS.tolerance)
    for prompt, row in zip(PROMPTS, rows, strict=True):
        print(
            f"{'pass' if row['passed'] else 'FAIL'}  {row['matching_tokens']:2d}/{row['of']} "
            f"tokens alike, near-tie gap {row['max_near_tie_gap']:.3f}, logprob difference "
            f"{row['max_logprob_difference']:.3f}  {prompt!r}"
        )
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(
            json.dumps(dict(tolerance=FLAGS.tolerance, prompts=rows), indent=1)
        )
    raise SystemExit(0 if all(row["passed"] for row in rows) else 1)


if __name__ == "__main__":
    app.run(main)
