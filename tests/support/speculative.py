"""Speculative-decoding test helpers: mixed prompts and parameters, a biased verifier and the
chi-square test of two samples."""

from __future__ import annotations

import collections
import random

import numpy as np
from scipy import stats

from jaxinfer import SamplingParams


def prompts_and_params(count: int, seed: int = 0) -> tuple[list, list]:
    """Prompts that repeat a motif (so n-gram proposals are found) or are random, each with
    its own sampling parameters and proposal limit (None: the engine's, 0 to 8)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        if i % 4 == 3:
            prompts.append([rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))])
        else:
            motif = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 7))]
            prompts.append((motif * 20)[: rng.randrange(8, 48)])
        extra = [
            {},
            {"temperature": 0.8, "top_p": 0.9},
            {"temperature": 1.0, "top_k": 20},
            {"temperature": 0.7, "min_p": 0.05},
            {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3},
            {"logit_bias": {5: 3.0, 7: -100.0}},
            {"stop": ["ab", "e"], "include_stop_str_in_output": bool(i % 2)},
            {"stop_token_ids": [prompts[-1][1]]},
            {"min_tokens": 6, "stop_token_ids": [prompts[-1][0]]},
            {"bad_words": ["the", " a"]},
            {"structured_outputs": {"regex": "[a-f]{2,12}( [0-9]+)?"}},
            {"n": 2, "temperature": 0.9},
        ][i % 12]
        params.append(
            SamplingParams(
                **{
                    "temperature": 0.0,
                    "seed": 1000 + i,
                    "max_tokens": rng.randrange(8, 40),
                    "logprobs": 2 if i % 3 == 0 else None,
                    "num_speculative_tokens": rng.choice([None, 0, 1, 2, 3, 4, 5, 6, 7, 8]),
                    **extra,
                }
            )
        )
    return prompts, params


def without_override(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "num_speculative_tokens": None})


def completions(outputs) -> list:
    return [
        [(c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason) for c in o.outputs]
        for o in outputs
    ]


# The tiny model's own distributions are nearly flat; a bias on five tokens (applied to p at
# every position, as any logits processor) concentrates them, the prompt's pattern among
# them, so proposals are made and often accepted, and 1200 samples fill the categories.
BIAS = {11: 7.0, 12: 7.0, 13: 7.0, 14: 7.0, 20: 7.0}


NUM_SAMPLES = 1200


def pairs(llm, params: SamplingParams, seeds: range) -> collections.Counter:
    """Counts of (2nd, 3rd) output tokens: the first sampled in steps that verify proposals."""
    outputs = llm.generate(
        [DISTRIBUTION_PROMPT] * len(seeds),
        [SamplingParams(**{**params.__dict__, "seed": seed}) for seed in seeds],
        use_tqdm=False,
    )
    return collections.Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outputs)


def accept_all(self, request, item, sampled):
    """A biased Scheduler._verify: every proposal kept, whatever was sampled."""
    drafts = item.draft_token_ids
    if drafts:
        request.spec.record(len(drafts), len(drafts))
    return [*drafts, sampled[len(drafts)]]


def homogeneity_pvalue(a: collections.Counter, b: collections.Counter) -> float:
    """Chi-square test that two samples come from one distribution (categories seen fewer
    than 10 times in all pooled)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest_a = sum(a.values()) - sum(a[k] for k in keys)
    rest_b = sum(b.values()) - sum(b[k] for k in keys)
    table = np.array([[a[k] for k in keys] + [rest_a], [b[k] for k in keys] + [rest_b]])
    table = table[:, table.sum(axis=0) > 0]
    return stats.chi2_contingency(table).pvalue


DISTRIBUTION_PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
