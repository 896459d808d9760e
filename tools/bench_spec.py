"""Speculative decoding's methods against none, on the same requests, in one process.

    python -m tools.bench_spec --model=qwen2.5-coder-1.5b --methods=ngram,suffix \
        --workloads=edit,write,agent --batch_sizes=1,8,32
    python -m tools.bench_spec --model=qwen2.5-coder-1.5b --methods=draft \
        --draft_model=qwen2.5-coder-0.5b --workloads=edit,write

One engine without speculation and one per method (--methods; the other engine flags apply
to all), each workload at each batch size (--batch_sizes: that many requests at once, the
workload's prompts repeated to fill them), the engines taking turns for --rounds after a
first pass (every shape compiled, the step times measured), greedy:
- edit: rewrite or lightly edit a given text or code, until the end of sequence or
  --edit_max_tokens: the output repeats much of the input, which prompt lookup proposes;
- write: write new code from a description (little of it is in the prompt);
- agent: the same tool-call shapes over and over (an agent's loop), in turns: each batch of
  requests runs after the previous one, so recent outputs can propose;
- chat: chat prompts with ignore_eos, output lengths spread over [--min_output_len,
  --max_output_len] (tools/bench_throughput.py's workload), at least 8 requests a run (in
  turns where the batch is smaller).

Reports per workload, batch size and method: output tokens per second (median over rounds),
the ratio to none, the acceptance rate (accepted / proposed tokens), the mean acceptance
length (tokens a request gains per step that verifies proposals: 1 + the accepted ones), the
accepted share per proposal position, and the share of the run spent proposing (host
lookups, or the draft model's steps); for suffix decoding the server tree's size.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from tools.chat_topics import TOPICS

FLAGS = flags.FLAGS
flags.DEFINE_list("methods", ["ngram"], "Speculative methods to compare with none.")
flags.DEFINE_list("workloads", ["edit", "chat"], "Workloads: edit, write, agent, chat.")
flags.DEFINE_list("batch_sizes", ["1"], "Requests at once (each workload at each).")
flags.DEFINE_integer("rounds", 3, "Rounds of each engine in turn; medians reported.")
flags.DEFINE_integer("edit_max_tokens", 320, "Most output tokens of an edit request.")
flags.DEFINE_integer("write_max_tokens", 256, "Most output tokens of a write request.")
flags.DEFINE_integer("agent_max_tokens", 160, "Most output tokens of an agent request.")
flags.DEFINE_integer("min_output_len", 32, "Shortest chat output (tokens).")
flags.DEFINE_integer("max_output_len", 160, "Longest chat output (tokens).")
CHAT_REQUESTS = 8  # the fewest chat requests a run makes (in turns of the batch size)

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


WRITES = [
    "Write a Python function that parses an ISO 8601 date string into a datetime without "
    "using datetime.fromisoformat. Output only the code.",
    "Write a Python class implementing an LRU cache with get and put in O(1). Output only "
    "the code.",
    "Write a JavaScript function that debounces another function. Output only the code.",
    "Write a SQL query that returns the three best-selling products per month from tables "
    "orders(id, month) and order_items(order_id, product, quantity). Output only the query.",
]

AGENT_SYSTEM = (
    "You are an agent that answers by calling tools. Reply with one JSON tool call per line, "
    'each of the form {"name": "get_weather", "arguments": {"city": "...", "unit": '
    '"celsius", "days": N}} and nothing else.'
)
CITIES = [
    "Paris", "Lagos", "Lima", "Osaka", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi",
    "Porto", "Turin", "Accra", "Seoul", "Sofia", "Tunis",
]  # fmt: skip


def agent_prompt(i: int) -> str:
    cities = ", ".join(CITIES[(i + j) % len(CITIES)] for j in range(4))
    return f"Get the weather for the next {2 + i % 5} days in {cities}."


@dataclasses.dataclass
class Run:
    tokens: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def chat_prompt(llm: LLM, text: str, system: str | None = None) -> list[int]:
    tokenizer = llm.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    rendered = tokenizer.apply_chat_template([*messages, {"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_special_tokens=False)


def in_turns(llm: LLM, prompts: list[list[int]], params, batch: int) -> Run:
    """`prompts` in groups of `batch` at once, one group after the other."""
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        group_params = params[first : first + batch] if isinstance(params, list) else params
        for output in llm.generate(group, group_params, use_tqdm=False):
            tokens += len(output.outputs[0].token_ids)
    return Run(tokens, time.perf_counter() - start)


def fill(texts: list[str], batch: int) -> list[str]:
    """The texts, repeated to a multiple of `batch` (at least one pass over them)."""
    count = -(-len(texts) // batch) * batch
    return [texts[i % len(texts)] for i in range(count)]


def run_edit(llm: LLM, batch: int) -> Run:
    params = SamplingParams(temperature=0, max_tokens=FLAGS.edit_max_tokens)
    return in_turns(llm, [chat_prompt(llm, t) for t in fill(EDITS, batch)], params, batch)


def run_write(llm: LLM, batch: int) -> Run:
    params = SamplingParams(temperature=0, max_tokens=FLAGS.write_max_tokens)
    return in_turns(llm, [chat_prompt(llm, t) for t in fill(WRITES, batch)], params, batch)


def run_agent(llm: LLM, batch: int) -> Run:
    texts = [agent_prompt(i) for i in range(max(8, 2 * batch))]
    prompts = [chat_prompt(llm, t, AGENT_SYSTEM) for t in fill(texts, batch)]
    params = SamplingParams(temperature=0, max_tokens=FLAGS.agent_max_tokens)
    return in_turns(llm, prompts, params, batch)


def run_chat(llm: LLM, batch: int) -> Run:
    """`batch` requests at once, at least CHAT_REQUESTS in all (in turns): one request of 32
    tokens is a run too short to time."""
    count = -(-max(batch, CHAT_REQUESTS) // batch) * batch
    rng = np.random.default_rng(0)
    prompts = [
        chat_prompt(llm, f"Explain {TOPICS[i % len(TOPICS)]} to a {10 + i}-year-old.")
        for i in range(count)
    ]
    lengths = np.linspace(FLAGS.min_output_len, FLAGS.max_output_len, count)
    lengths = rng.permutation(np.round(lengths).astype(int)).tolist()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    return in_turns(llm, prompts, params, batch)


WORKLOADS = {"edit": run_edit, "write": run_write, "agent": run_agent, "chat": run_chat}


def spec_counts(llm: LLM):
    return llm.engine.stats().spec


def main(argv):
    del argv
    if FLAGS.draft_model is not None:  # (the flags must make one valid engine: the draft's)
        FLAGS.speculative_method = "draft"
    options = engine_options_from_flags()
    engines = {
        "none": LLM(
            **dataclasses.asdict(
                dataclasses.replace(options, speculative_method="none", draft_model=None)
            )
        )
    }
    for method in FLAGS.methods:
        draft_model = options.draft_model if method == "draft" else None
        engines[method] = LLM(
            **dataclasses.asdict(
                dataclasses.replace(options, speculative_method=method, draft_model=draft_model)
            )
        )
    for workload in FLAGS.workloads:
        for batch in map(int, FLAGS.batch_sizes):
            run = functools.partial(WORKLOADS[workload], batch=batch)
            for llm in engines.values():
                run(llm)  # a first pass: every shape compiled, the step times measured
            runs = {name: [] for name in engines}
            before = {m: spec_counts(engines[m]) for m in FLAGS.methods}
            proposing = {m: engines[m].engine.speculation.seconds for m in FLAGS.methods}
            for _ in range(FLAGS.rounds):
                for name, llm in engines.items():
                    llm.engine.reset_prefix_cache()
                    runs[name].append(run(llm))
            rates = {name: float(np.median([r.rate for r in rs])) for name, rs in runs.items()}
            print(
                f"{workload}, batch {batch}: output tokens/s "
                + ", ".join(f"{n} {r:.1f}" for n, r in rates.items())
                + f" ({runs['none'][0].tokens} tokens a run)",
                flush=True,
            )
            for method in FLAGS.methods:
                seconds = engines[method].engine.speculation.seconds - proposing[method]
                report(method, engines[method], runs, rates, before[method], seconds)


def report(method, llm, runs, rates, before, proposing: float) -> None:
    spec = spec_counts(llm)
    drafts = spec.num_drafts - before.num_drafts
    proposed = spec.num_draft_tokens - before.num_draft_tokens
    accepted = spec.num_accepted_tokens - before.num_accepted_tokens
    per_position = np.subtract(
        spec.accepted_per_position,
        before.accepted_per_position
        + [0] * (len(spec.accepted_per_position) - len(before.accepted_per_position)),
    )
    ratios = [s.rate / o.rate for s, o in zip(runs[method], runs["none"], strict=True)]
    rate = accepted / proposed if proposed else 0.0
    length = 1 + accepted / drafts if drafts else 1.0
    total = sum(r.seconds for r in runs[method])
    control = llm.engine.speculation.control
    print(
        f"  {method}: {rates[method] / rates['none']:.2f}x (per round: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"); acceptance {rate:.2f} ({accepted} of {proposed}), mean acceptance length "
        f"{length:.2f} over {drafts} request steps; accepted per position "
        + "/".join(f"{a / drafts:.2f}" for a in per_position if drafts)
        + f"; proposing {100 * proposing / total:.1f}% of the run"
        + (
            f"; steps planned {control.planned}, declined {control.declined}, "
            f"revisited {control.revisited}"
            if control is not None
            else ""
        )
        + (f"; suffix index {llm.engine.speculation.host.memory()}" if method == "suffix" else ""),
        flush=True,
    )
    if control is not None and 1 in control.target:  # (one request sampling: batch 1)
        table = control.target[1]
        print(
            "  step ms by scheduled tokens, one request: "
            + ", ".join(f"{t} {1e3 * table.seconds[t]:.0f}" for t in table.keys if t <= 17),
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
