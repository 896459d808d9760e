"""One process of a job driven through the Python API, for tests/server/test_multiprocess.py:

    python -m tests.support.multiprocess_job SPEC.json

SPEC (JSON): model, options (EngineOptions), prompts (lists of token ids), params
(SamplingParams), output (a path), distributed ({coordinator_address, num_processes,
process_id}, or null for one process), and mode:

- "generate": every process makes the same calls (the LLM API under jax.distributed: each
  runs the script); process 0 writes [[token ids, logprob of each]] of every prompt to output.
- "diverge": process 0 leads (jaxinfer.engine.lockstep) under check_schedule, and process 1
  replays its requests with one more prompt token each: the check must stop both. Each
  process writes what stopped it to output.<process id>.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jaxinfer import SamplingParams
from jaxinfer.engine import lockstep
from jaxinfer.parallel.distributed import DistributedConfig, initialize
from tests.support.engines import build_engine, build_llm


def generate(spec: dict) -> None:
    import jax

    llm = build_llm(spec["model"], None, **spec["options"])
    outputs = llm.generate(spec["prompts"], SamplingParams(**spec["params"]), use_tqdm=False)
    results = []
    for output in outputs:
        sample = output.outputs[0]
        chosen = [
            entry[token] for entry, token in zip(sample.logprobs, sample.token_ids, strict=True)
        ]
        results.append([sample.token_ids, chosen])
    if jax.process_index() == 0:
        Path(spec["output"]).write_text(json.dumps(results))


def diverge(spec: dict, distributed: DistributedConfig) -> None:
    engine = build_engine(spec["model"], None, check_schedule=True, **spec["options"])
    out = Path(f"{spec['output']}.{distributed.process_id}")
    params = SamplingParams(**spec["params"])
    if distributed.process_id > 0:
        replay = lockstep.apply_call

        def one_more_token(engine, call):  # the injected divergence
            if isinstance(call, lockstep.AddRequest):
                longer = (*call.prompt_token_ids, 0)
                call = lockstep.AddRequest(
                    longer, call.params, call.request_id, call.priority, call.cache_salt
                )
            replay(engine, call)

        lockstep.apply_call = one_more_token
    try:
        leader = lockstep.lead_or_follow(engine, distributed)
        if leader is not None:
            for prompt in spec["prompts"]:
                leader.add_request(prompt, params)
            while leader.has_unfinished_requests():
                leader.step()
            leader.close()
        out.write_text("finished")
    except Exception as error:
        out.write_text(f"{type(error).__name__}: {error}")
    sys.stdout.flush()
    os._exit(0)  # not JAX's shutdown: the other process may have stopped first


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    distributed = DistributedConfig(**(spec["distributed"] or {}))
    if spec["mode"] == "generate":
        initialize(distributed)
        generate(spec)
    else:
        initialize(distributed, recoverable=True)
        diverge(spec, distributed)


if __name__ == "__main__":
    main()
