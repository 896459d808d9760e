"""The prompts and the fixed projection of the real-model references
(tools/real_model_references.py writes them, tests/engine/test_real_models.py reads them)."""

from __future__ import annotations

import numpy as np

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
