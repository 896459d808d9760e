"""Speculative decoding on the real models: under batch_invariant, every method's greedy
outputs are the model's own token for token (the same engine with num_speculative_tokens=0
per request is the reference), with proposals made and accepted: n-gram and suffix decoding
on Qwen2.5-Coder-0.5B, the 0.5B drafting for the 1.5B (the pair the presets fetch).

In the default-model lane (the presets' files are fetched once, cached)."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from tests.support.engines import build_llm

pytestmark = pytest.mark.default_model

PROMPTS = [
    "Rename the variable `xs` to `values` and output only the code:\n\n"
    "def mean(xs):\n    return sum(xs) / len(xs)\n\n\ndef spread(xs):\n"
    "    return max(xs) - min(xs)\n",
    "Write a Python function that returns the n-th Fibonacci number.",
]
OPTIONS = dict(
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    token_buckets=(16,),
    block_size=16,
    num_kv_blocks=64,
    batch_invariant=True,
    num_speculative_tokens=4,
    speculative_adaptive=False,  # (the counts below; the outputs do not depend on it)
)


def greedy_outputs(llm, speculate: bool) -> list[list[int]]:
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": text}]),
            add_special_tokens=False,
        )
        for text in PROMPTS
    ]
    params = SamplingParams(
        temperature=0, max_tokens=24, num_speculative_tokens=None if speculate else 0
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    ("model", "method"),
    [
        ("qwen2.5-coder-0.5b", dict(speculative_method="ngram")),
        ("qwen2.5-coder-0.5b", dict(speculative_method="suffix")),
        (
            "qwen2.5-coder-1.5b",
            dict(speculative_method="draft", draft_model="qwen2.5-coder-0.5b"),
        ),
    ],
    ids=["ngram", "suffix", "draft"],
)
def test_greedy_outputs_are_the_models_own(model, method, model_cache_dir):
    llm = build_llm(model, None, cache_dir=str(model_cache_dir), **OPTIONS, **method)
    expected = greedy_outputs(llm, speculate=False)
    before = llm.engine.stats().spec
    got = greedy_outputs(llm, speculate=True)
    spec = llm.engine.stats().spec
    proposed = spec.num_draft_tokens - before.num_draft_tokens
    accepted = spec.num_accepted_tokens - before.num_accepted_tokens
    print(f"{method}: accepted {accepted} of {proposed}")
    assert got == expected
    assert accepted > 5
