"""The prompts, transformers' greedy generation with its top logprobs, and the fixed
projection of the real-model references (tools/real_model_references.py writes them,
tests/engine/test_real_models.py reads them; tests/engine/test_default_model.py generates
the same way)."""

from __future__ import annotations

import numpy as np
import torch

MAX_TOKENS = 48
TOP = 5
PROJECTIONS = 16  # directions each hidden state is projected on

QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "What does the `yield` keyword do in Python? Answer in two sentences.",
    "Explain the difference between a list and a tuple.",
    "Write a SQL query that returns the ten most recent orders.",
    "Why is the sky blue?",
    "Fix the bug: def add(a, b): return a - b",
    "Write a bash one-liner that counts the lines of every .py file in a folder.",
    "Name three sorting algorithms and their time complexity.",
]


def projection(width: int) -> np.ndarray:
    """f32[E, PROJECTIONS]: the fixed directions the tests project hidden states on."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal((width, PROJECTIONS)) / np.sqrt(width)).astype(np.float32)


def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[dict]]:
    """(tokens, each step's {token id: logprob} of the TOP best) of a transformers model's
    greedy generation (float32 log-softmax of its logits)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    tops = []
    for logits in out.logits:
        values, ids = torch.topk(torch.log_softmax(logits[0].float(), -1), TOP)
        tops.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    return tokens, tops
