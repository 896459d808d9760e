"""Per-step host time, device time and the device's idle gap, for the default model.

    python tools/profile_step.py --batch_sizes=1,32 --output_len=64

For each batch size, B identical-length chat requests decode together (greedy, ignore_eos);
for every step after the prefill the engine records when scheduling began, when the step was
enqueued, when its tokens were ready and when the step returned. Reported (median and p90 over
the decode steps):

- host: Python work of the step (scheduling, batch building, transfers, dispatch, then
  fetching, stop checks, detokenization);
- device: from the first transfer of the step to its tokens being ready (an upper bound on
  the device's work: it includes the dispatch of the first program);
- idle gap: from one step's tokens being ready to the next step's first transfer, the time the
  device waits for the host.
"""

from __future__ import annotations

import itertools

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "32"], "Concurrent requests.")
flags.DEFINE_integer("output_len", 64, "Tokens per request.")


def profile(llm: LLM, batch_size: int) -> dict[str, np.ndarray]:
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
    decode = [t for t in timings if t.num_tokens == t.num_reqs]  # steps with no prefill
    host = [(t.dispatched - t.start) + (t.end - t.ready) for t in decode]
    device = [t.ready - t.built for t in decode]
    gaps = [b.built - a.ready for a, b in itertools.pairwise(decode)]
    return {"host": np.array(host), "device": np.array(device), "idle gap": np.array(gaps)}


def main(argv):
    del argv
    llm = LLM()
    for batch_size in map(int, FLAGS.batch_sizes):
        result = profile(llm, batch_size)
        steps = len(result["device"])
        parts = ", ".join(
            f"{name} {np.median(v) * 1e3:.2f} ms (p90 {np.percentile(v, 90) * 1e3:.2f})"
            for name, v in result.items()
        )
        print(f"batch {batch_size}: {steps} decode steps: {parts}")


if __name__ == "__main__":
    app.run(main)
