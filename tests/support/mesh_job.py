"""A greedy run of the LLM API on a mesh of this process's CPU devices, for
tests/engine/test_loaded_mesh.py:

    python -m tests.support.mesh_job MODEL_DIR TP ROUNDS

(JAX_NUM_CPU_DEVICES=TP.) Prints one line of JSON: each prompt's token ids, per round."""

from __future__ import annotations

import json
import sys

from jaxinfer import SamplingParams
from tests.support.engines import build_llm

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def main() -> None:
    model, tp, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = build_llm(
        model,
        "tiny",
        tensor_parallel_size=tp,
        layer_execution="per_layer",  # a program per layer: the host runs far ahead
        compilation_cache=False,
        use_tqdm=False,
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = [
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        for _ in range(rounds)
    ]
    print(json.dumps(runs), flush=True)


if __name__ == "__main__":
    main()
