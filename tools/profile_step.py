"""Per-step host time, device time and the device's idle gap, for the default model.

    python -m tools.profile_step --batch_sizes=1,32 --output_len=64

For each batch size, B identical-length chat requests decode together (greedy, ignore_eos),
once with one step at a time (sync) and once with async scheduling (step N+1 scheduled and
enqueued while step N runs), on the same engine. Reported per decode step (median and p90):

- host: the step's Python work (scheduling, batch building, transfers, dispatch, then
  fetching, stop checks, detokenization);
- device: in sync mode, from the first transfer of a step to its tokens being ready (an upper
  bound on the device's work: it includes dispatching the programs);
- period: time between consecutive steps' outputs, what a request sees per token;
- - idle gap: in sync mode, from one step's tokens being ready to the next step's first
  transfer (the device waits for the host all that time); in async mode, the median period
  minus the sync device time (what the host still adds), and the share of steps whose
  successor was enqueued before they finished.

Then, for each batch size, a table of where the decode step's device time goes (embedding,
layers without attention, attention, LM head, sampler; tools/step_breakdown.py) against the
roofline of each part, with the sync host time beside it; the parts are timed as per-layer
programs (on a second engine where the default runs the layers under a scan). --breakdown_only
skips the engine runs and reports the tables with the host time left out.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config.flags import define_engine_flags, engine_options_from_flags
from jaxinfer.engine.execution.step import StepTiming
from tools.step_breakdown import table

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "32"], "Concurrent requests.")
flags.DEFINE_integer("output_len", 64, "Tokens per request.")
flags.DEFINE_integer("context", 80, "Context per request in the breakdown's decode batch.")
flags.DEFINE_bool("breakdown_only", False, "Only the per-part tables (no host timing runs).")
define_engine_flags()  # the engine's options (--config, --quantization, ...), as the server's


def profile(llm: LLM, batch_size: int) -> list[StepTiming]:
    engine = llm.engine
    tokenizer = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=FLAGS.output_len, ignore_eos=True)
    for i in range(batch_size):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about the number {i}."}]
        )
        engine.add_request(tokenizer.encode(text, add_special_tokens=False), params)
    timings = []
    while engine.has_unfinished_requests():
        engine.step()
        timings.append(engine.last_step_timing)
    # Decode steps only (no prefill), and not the last few, where requests start finishing.
    return [t for t in timings if t.num_tokens == t.num_reqs == batch_size][1:-2]


def summary(name: str, values) -> str:
    values = np.asarray(values) * 1e3
    return f"{name} {np.median(values):.2f} ms (p90 {np.percentile(values, 90):.2f})"


def main(argv):
    del argv
    options = engine_options_from_flags()
    llm = LLM(**dataclasses.asdict(options))
    config = llm.engine.config

    def scheduling(on: bool):  # the same engine, one step at a time or overlapped
        return dataclasses.replace(
            config, resolved=dataclasses.replace(config.resolved, async_scheduling=on)
        )

    sync_config, async_config = scheduling(False), scheduling(True)
    hosts = {}
    for batch_size in map(int, FLAGS.batch_sizes):
        if FLAGS.breakdown_only:
            hosts[batch_size] = float("nan")
            continue
        llm.engine.config = sync_config
        steps = profile(llm, batch_size)
        host = [(t.dispatched - t.start) + (t.end - t.ready) for t in steps]
        device = [t.ready - t.built for t in steps]
        period = [b.end - a.end for a, b in itertools.pairwise(steps)]
        gaps = [b.built - a.ready for a, b in itertools.pairwise(steps)]
        print(
            f"batch {batch_size}, sync, {len(steps)} decode steps: "
            + ", ".join(
                summary(n, v)
                for n, v in [
                    ("host", host),
                    ("device", device),
                    ("period", period),
                    ("idle gap", gaps),
                ]
            )
        )
        hosts[batch_size] = float(np.median(host))
        llm.engine.config = async_config
        steps = profile(llm, batch_size)
        host = [(t.dispatched - t.start) + (t.end - t.ready) for t in steps]
        period = [b.end - a.end for a, b in itertools.pairwise(steps)]
        overlapped = np.mean([t.overlapped for t in steps])
        gap = max(np.median(period) - np.median(device), 0.0)
        print(
            f"batch {batch_size}, async, {len(steps)} decode steps: "
            + ", ".join(summary(n, v) for n, v in [("host", host), ("period", period)])
            + f", idle gap ~{gap * 1e3:.2f} ms (period - sync device), successor enqueued "
            f"before the step finished in {overlapped:.0%} of steps"
        )
    if llm.engine.config.layer_execution != "per_layer":
        # the parts are timed one layer program at a time: a second engine, same kernels
        del llm
        llm = LLM(**dataclasses.asdict(dataclasses.replace(options, layer_execution="per_layer")))
    for batch_size, host in hosts.items():
        print()
        print(table(llm, batch_size, FLAGS.context, host))


if __name__ == "__main__":
    app.run(main)
