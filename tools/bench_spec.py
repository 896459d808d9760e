"""Speculative decoding against none, on the same requests, in one process.

    python -m tools.bench_spec --rounds=3

Two workloads, each run by an engine without speculation and one with n-gram proposals
(--speculative_method and the other engine flags set the second; none is the first). A draft
model: --speculative_method=draft --draft_model=FOLDER (tools/truncated_model.py makes one
from the default model's first layers).
- edit: prompts asking to rewrite or lightly edit a given text or code, run one at a time
  (batch 1), greedy, until the end of sequence or --edit_max_tokens: the output repeats much
  of the input, which prompt lookup proposes.
- chat: --num_requests chat prompts together, greedy with ignore_eos, output lengths spread
  evenly over [--min_output_len, --max_output_len] (tools/bench_throughput.py's workload).

Reports output tokens per second of each engine (medians over --rounds, the engines taking
turns), the ratio, and the speculative engine's acceptance rate (accepted / proposed tokens)
and mean acceptance length (tokens a request gains per step that verifies proposals: 1 + the
accepted ones), and the share of its run spent proposing (the host's n-gram lookups, or the
draft model's steps).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from tools.chat_topics import TOPICS

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", ["edit", "chat"], "Workloads to run: edit, chat.")
flags.DEFINE_integer("rounds", 3, "Rounds of each engine in turn; medians reported.")
flags.DEFINE_integer("edit_max_tokens", 320, "Most output tokens of an edit request.")
flags.DEFINE_integer("num_requests", 32, "Requests of the chat workload.")
flags.DEFINE_integer("min_output_len", 32, "Shortest chat output (tokens).")
flags.DEFINE_integer("max_output_len", 160, "Longest chat output (tokens).")

define_engine_flags()

EDITS = [
    (
        "Rewrite the following text, replacing every British spelling with the American one. "
        "Output only the rewritten text.\n\n"
        "The colour of the harbour changes with the seasons. In summer the water is a bright, "
        "clear blue, and the neighbours gather on the quay to watch the boats. In autumn the "
        "colour turns grey, the harbour grows quiet, and the fishermen repair their nets. The "
        "town's favourite festival is held in the centre of the harbour every spring. Visitors "
        "travel from all over the country to see the parade of decorated boats, and the local "
        "theatre puts on a programme of music and dance. The organisers say the festival "
        "celebrates the town's long history of fishing and its honour of the sea. Children "
        "paint the harbour wall in bright colours, and in the evening the whole town gathers "
        "to watch the fireworks over the water. When the festival is over, the neighbours "
        "clean the quay together, and the harbour returns to its quiet rhythm until the next "
        "spring."
    ),
    (
        "Add type hints to this Python function. Output only the code.\n\n"
        "def moving_average(values, window):\n"
        "    if window <= 0:\n"
        "        raise ValueError('window must be positive')\n"
        "    averages = []\n"
        "    total = 0\n"
        "    for index, value in enumerate(values):\n"
        "        total += value\n"
        "        if index >= window:\n"
        "            total -= values[index - window]\n"
        "        if index >= window - 1:\n"
        "            averages.append(total / window)\n"
        "    return averages\n"
    ),
    (
        "Fix the typos in this paragraph and output the corrected paragraph only.\n\n"
        "Speculative decoding lets a small proposer guess severl tokens ahead. The large model "
        "then checks all of the guesses in one forward pass, and every guess it agrees with is "
        "kept. Because decoding is limited by reading the wieghts, checking five tokens costs "
        "about as much as producing one, so the output arrives faster whenever the guesses "
        "are good. The simplest proposer looks for the last few tokens earlier in the text and "
        "proposes what folowed them there. It needs no second model and costs almost nothing, "
        "and it works best when the output repeats the input, as it does when a text is "
        "edited, summarised with quotations, or translated between two programming languages "
        "that share most of their syntax. A draft model guesses better on open-ended text, but "
        "it must be run for every guess and its cache must be kept in step with the large "
        "model's."
    ),
    (
        "Rename the variable `data` to `records` in this code. Output only the code.\n\n"
        "def summarize(data):\n"
        "    count = len(data)\n"
        "    if count == 0:\n"
        "        return {}\n"
        "    total = sum(item['amount'] for item in data)\n"
        "    largest = max(data, key=lambda item: item['amount'])\n"
        "    return {'count': count, 'total': total, 'largest': largest['name']}\n"
    ),
]


@dataclasses.dataclass
class Run:
    tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def chat_prompt(llm: LLM, text: str) -> list[int]:
    tokenizer = llm.tokenizer
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)


def run_edit(llm: LLM) -> Run:
    params = SamplingParams(temperature=0, max_tokens=FLAGS.edit_max_tokens)
    tokens, start = 0, time.perf_counter()
    for text in EDITS:  # batch 1: one request at a time
        output = llm.generate([chat_prompt(llm, text)], params, use_tqdm=False)[0]
        tokens += len(output.outputs[0].token_ids)
    return Run(tokens, time.perf_counter() - start)


def run_chat(llm: LLM) -> Run:
    rng = np.random.default_rng(0)
    prompts = [
        chat_prompt(llm, f"Explain {TOPICS[i % len(TOPICS)]} to a {10 + i}-year-old.")
        for i in range(FLAGS.num_requests)
    ]
    lengths = np.linspace(FLAGS.min_output_len, FLAGS.max_output_len, FLAGS.num_requests)
    lengths = rng.permutation(np.round(lengths).astype(int)).tolist()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return Run(sum(len(o.outputs[0].token_ids) for o in outputs), elapsed)


WORKLOADS = {"edit": run_edit, "chat": run_chat}


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    spec = llm.engine.stats().spec
    return spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens


class ProposeTimer:
    """Wraps an engine's proposal step (host n-gram lookup, or the draft model's steps) and
    adds up its seconds."""

    def __init__(self, engine):
        self.seconds = 0.0
        propose = engine._propose

        def timed():
            start = time.perf_counter()
            propose()
            self.seconds += time.perf_counter() - start

        engine._propose = timed


def main(argv):
    del argv
    options = engine_options_from_flags()
    method = options.speculative_method if options.speculative_method != "none" else "ngram"
    engines = {
        "off": LLM(
            **dataclasses.asdict(
                dataclasses.replace(options, speculative_method="none", draft_model=None)
            )
        ),
        method: LLM(**dataclasses.asdict(dataclasses.replace(options, speculative_method=method))),
    }
    spec_llm = engines[method]
    timer = ProposeTimer(spec_llm.engine)
    for workload in FLAGS.workloads:
        run = WORKLOADS[workload]
        for llm in engines.values():
            run(llm)  # a first pass: every shape of this workload compiled, caches warm
        runs = {name: [] for name in engines}
        before = spec_counts(spec_llm)
        timer.seconds = 0.0
        for _ in range(FLAGS.rounds):
            for name, llm in engines.items():
                llm.engine.reset_prefix_cache()
                runs[name].append(run(llm))
        drafts, proposed, accepted = np.subtract(spec_counts(spec_llm), before)
        rates = {name: float(np.median([r.rate for r in rs])) for name, rs in runs.items()}
        ratios = [s.rate / o.rate for s, o in zip(runs[method], runs["off"], strict=True)]
        print(f"{workload}: output tokens/s " + ", ".join(f"{n} {r:.1f}" for n, r in rates.items()))
        print(
            f"  {method} / off: {rates[method] / rates['off']:.2f}x (per round: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + f"); tokens per run: off {runs['off'][0].tokens}, {method} {runs[method][0].tokens}"
        )
        rate = accepted / proposed if proposed else 0.0
        length = 1 + accepted / drafts if drafts else 1.0
        print(
            f"  acceptance rate {rate:.2f} ({accepted} of {proposed} proposed), mean acceptance "
            f"length {length:.2f} over {drafts} request steps with proposals"
        )
        total = sum(r.seconds for r in runs[method])
        print(
            f"  proposing ({method}): {timer.seconds:.2f} s of the {total:.1f} s it ran "
            f"({100 * timer.seconds / total:.1f}%)"
        )


if __name__ == "__main__":
    app.run(main)
