"""Host proposers (n-gram, suffix) replayed over a model's recorded greedy outputs, no model run.

    python -m tools.spec_replay --model=qwen2.5-coder-1.5b --workloads=edit,agent
    python -m tools.spec_replay --model=qwen2.5-coder-1.5b --workloads=edit \
        --suffix_max_spec_factor=2 --step_ms=77 --token_ms=32

The first run records each workload's greedy outputs (tools/bench_spec.py's prompts, at batch
1, in turns) with the model and keeps them in --record (a JSON file); later runs read them.
Then each method proposes after every step as the engine's does (the same proposer objects
and SpecState, the plan of jaxinfer.engine.speculation.control over a step time modelled as
--step_ms + --token_ms per scheduled token), the leading proposals equal to the recorded
tokens are accepted (the plan before the lookup, then the scheduler's over what it found),
and the suffix cache takes each finished output. Reports per workload and method: verify
steps, tokens per step, acceptance, and the modelled speed-up against no speculation. A
proposer's change is judged here in seconds, then measured by bench_spec.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from jaxinfer.config import EngineOptions, SchedulerConfig, SpeculativeConfig
from jaxinfer.engine.speculation.control import SpecControl, plan_proposals, record_verdict
from jaxinfer.engine.speculation.ngram import leading
from jaxinfer.engine.speculation.propose import at_most, make_proposer
from tools import bench_spec

FLAGS = flags.FLAGS
SPECULATIVE = (  # SpeculativeConfig's fields that are engine options of the same name
    "prompt_lookup_min",
    "prompt_lookup_max",
    "suffix_max_depth",
    "suffix_cache_max_tokens",
    "suffix_min_token_prob",
    "suffix_max_spec_factor",
)
flags.DEFINE_string("record", None, "JSON file of recorded outputs (default: per model).")
flags.DEFINE_list("replay_methods", ["ngram", "suffix"], "Host proposers replayed.")
flags.DEFINE_float("step_ms", 77.0, "Modelled step time: fixed part (ms).")
flags.DEFINE_float("token_ms", 32.0, "Modelled step time: per scheduled token (ms).")
flags.DEFINE_list(
    "step_times",
    [],
    "Measured step times as tokens:ms (bench_spec prints them), in place of the linear model "
    "(linear between them).",
)


def record_path() -> str:
    if FLAGS.record:
        return FLAGS.record
    name = os.path.basename(FLAGS.model.rstrip("/")) if FLAGS.model else "default"
    return os.path.expanduser(f"~/.cache/jaxinfer/spec_replay/{name}.json")


def prompts_of(llm, workload: str) -> tuple[list[list[int]], int]:
    if workload == "edit":
        texts, system, most = bench_spec.EDITS, None, FLAGS.edit_max_tokens
    elif workload == "write":
        texts, system, most = bench_spec.WRITES, None, FLAGS.write_max_tokens
    elif workload == "agent":
        texts = [bench_spec.agent_prompt(i) for i in range(8)]
        system, most = bench_spec.AGENT_SYSTEM, FLAGS.agent_max_tokens
    else:
        raise ValueError(f"workload {workload!r} is not replayed")
    return [bench_spec.chat_prompt(llm, t, system) for t in texts], most


def recorded() -> dict[str, list[list[list[int]]]]:
    """{workload: [[prompt, output], ...]}, recorded with the model where not on file."""
    path = record_path()
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    missing = [w for w in FLAGS.workloads if w not in data]
    if missing:
        from jaxinfer import LLM, SamplingParams
        from jaxinfer.config.flags import engine_options_from_flags

        llm = LLM(**vars(engine_options_from_flags(speculative_method="none")))
        for workload in missing:
            prompts, most = prompts_of(llm, workload)
            params = SamplingParams(temperature=0, max_tokens=most)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            data[workload] = [
                [p, list(o.outputs[0].token_ids)] for p, o in zip(prompts, outputs, strict=True)
            ]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    return data


def modelled(tokens: int) -> float:
    """A step's time (ms): --step_times where they cover `tokens`, else the linear model."""
    measured = sorted((int(t), float(ms)) for t, ms in (s.split(":") for s in FLAGS.step_times))
    if measured and measured[0][0] <= tokens <= measured[-1][0]:
        return float(np.interp(tokens, *zip(*measured, strict=True)))
    return FLAGS.step_ms + FLAGS.token_ms * tokens


def replay(method: str, pairs: list[list[list[int]]]) -> dict[str, float]:
    options = EngineOptions()  # (the engine's defaults where a flag is not given)
    value = {
        name: getattr(options, name) if FLAGS[name].value is None else FLAGS[name].value
        for name in SPECULATIVE
    }
    limit = FLAGS.num_speculative_tokens or 8
    config = SpeculativeConfig(method=method, num_speculative_tokens=limit, adaptive=True, **value)
    scheduler = SchedulerConfig(
        max_num_seqs=1,
        max_num_batched_tokens=512,
        max_model_len=4096,
        token_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        num_speculative_tokens=limit,
        spec_free_tokens=limit,
    )
    control = SpecControl(buckets=scheduler.token_buckets)
    for tokens in range(1, 2 * limit + 2):
        control.observe_step(tokens, 1, modelled(tokens) / 1e3)
    proposer = make_proposer(config)
    steps = verify_steps = proposed = accepted = 0
    seconds = baseline = 0.0
    for prompt, output in pairs:
        state = proposer.new_state(limit)
        done = 1  # (the prompt's step samples the first output token)
        seconds += modelled(len(prompt))
        baseline += modelled(len(prompt)) + modelled(1) * (len(output) - 1)
        while done < len(output):
            tokens = prompt + output[:done]
            room = len(output) - done - 1
            proposer.index(state, tokens)
            want = min(at_most(state), max(room, 0))
            plan = plan_proposals(scheduler, control, 1, 1, [(state, want)], host_rows=1)
            proposal = proposer.propose(state, tokens, room) if plan[0] else []
            if not plan[0]:
                state.wanted()
                state.declined()
            elif proposal:  # (the scheduler's plan over what was found)
                plan = plan_proposals(scheduler, control, 1, 1, [(state, len(proposal))])
                proposal = proposal[: plan[0]]
                if not plan[0]:
                    state.declined()
            hits = leading(proposal, output[done:])
            record_verdict(control, state, len(proposal), hits)
            steps += 1
            verify_steps += bool(proposal)
            proposed += len(proposal)
            accepted += hits
            seconds += modelled(1 + len(proposal))
            control.observe_tokens(1, 1 + hits, modelled(1 + len(proposal)) / 1e3)
            done += hits + 1
        proposer_finished = getattr(proposer, "finished", None)
        if proposer_finished is not None:
            proposer_finished(output)
    return {
        "steps": steps,
        "verify_steps": verify_steps,
        "acceptance": accepted / proposed if proposed else 0.0,
        "mean_length": 1 + accepted / verify_steps if verify_steps else 1.0,
        "speedup": baseline / seconds,
    }


def main(argv):
    del argv
    data = recorded()
    for workload in FLAGS.workloads:
        pairs = data[workload]
        print(f"{workload}: {sum(len(o) for _, o in pairs)} output tokens a pass")
        for method in FLAGS.replay_methods:
            r = replay(method, pairs)
            print(
                f"  {method}: modelled {r['speedup']:.2f}x; {r['steps']} steps, "
                f"{r['verify_steps']} verify; acceptance {r['acceptance']:.2f}, mean length "
                f"{r['mean_length']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
