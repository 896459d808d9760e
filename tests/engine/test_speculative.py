"""Speculative decoding (n-gram proposals): outputs equal to decoding without it, token for
token with batch_invariant (greedy and seeded sampling, every sampling parameter, grammars,
stop strings, n > 1, preemption, async scheduling, aborts) and logprob-close without it; the
sampled distribution unchanged (chi-square, shown first to reject a biased verifier).
Proposal rollback under random add/step/abort: tests/unit/test_scheduler_properties.py."""

from __future__ import annotations

import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.engine.speculation.suffix import KEY
from tests.support.checks import check_logprobs_close
from tests.support.speculative import (
    BIAS,
    NUM_SAMPLES,
    accept_all,
    completions,
    homogeneity_pvalue,
    pairs,
    prompts_and_params,
    without_override,
)

pytestmark = pytest.mark.engine

SPEC_ATOL = 1e-4  # with proposals against without, common prefix (nats; 1e-6 measured)

# (proposals may grow any step up to the budget, not only small ones, by the rule of thumb:
# the tests count what is scheduled, which measured step times would make vary)
SPEC = dict(
    speculative_method="ngram",
    num_speculative_tokens=8,
    prompt_lookup_min=1,
    speculative_free_tokens=64,
    speculative_adaptive=False,
)


def record_draft_counts(llm) -> list[set[int]]:
    """Wraps the engine's scheduler to record, per step, the proposal counts scheduled."""
    seen: list[set[int]] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording():
        output = schedule()
        seen.append({len(item.draft_token_ids) for item in output.scheduled})
        return output

    scheduler.schedule = recording
    return seen


@pytest.fixture(scope="module")
def baseline(make_llm):
    # (test_batch_invariant's engine: 16 tokens a step, 20 blocks; outputs do not depend on
    # either under batch_invariant)
    return make_llm("tiny", batch_invariant=True, num_kv_blocks=20, max_num_seqs=8)


@pytest.fixture(scope="module")
def speculative(make_llm):
    # 64 tokens a step, async scheduling on, and a pool of 32 blocks that 8 requests running
    # long outgrow: preemptions.
    return make_llm("served", batch_invariant=True, async_scheduling=True, num_kv_blocks=32, **SPEC)


@pytest.fixture(scope="module")
def cases():
    return prompts_and_params(48)


@pytest.fixture(scope="module")
def expected(baseline, cases):
    prompts, params = cases
    return completions(
        baseline.generate(prompts, [without_override(p) for p in params], use_tqdm=False)
    )


def test_bit_identical_to_no_speculation(speculative, cases, expected):
    prompts, params = cases
    before = speculative.engine.stats().spec
    seen = record_draft_counts(speculative)
    got = completions(speculative.generate(prompts, params, use_tqdm=False))
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not mismatched, f"{len(mismatched)} of {len(got)} differ: {mismatched}"
    spec = speculative.engine.stats().spec
    accepted = spec.num_accepted_tokens - before.num_accepted_tokens
    proposed = spec.num_draft_tokens - before.num_draft_tokens
    print(f"proposed {proposed}, accepted {accepted}")
    assert accepted > 100 and proposed > accepted  # proposals were made, some rejected
    assert len(spec.accepted_per_position) == 8 and spec.accepted_per_position[7] > 0
    assert any(len(counts) >= 3 and 0 in counts for counts in seen), "mixed proposal counts"
    assert speculative.engine.stats().num_preemptions > 0


def test_aborts_free_everything(speculative, cases, expected):
    engine = speculative.engine
    prompts, params = cases
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(prompt, p, request_id=request_id)
    finished = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step in (3, 9, 20):
            for request_id in ids[step % 5 :: 5]:
                engine.abort_request(request_id)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    for i, request_id in enumerate(ids):
        if request_id in finished:
            assert completions([finished[request_id]])[0] == expected[i]
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"
    # (rows go back with the next step; the ones still held are those released since)
    assert set(engine.batch_builder.rows._rows) <= set(engine.scheduler._released)


def test_suffix_decoding_with_adaptive_plans_is_bit_identical(make_llm, cases, expected):
    """Suffix decoding, its proposals planned by measured step times: the same tokens as
    decoding without speculation; a second pass over the same prompts finds the first
    pass's outputs in the server's index, which stays within its bound."""
    prompts, params = cases
    llm = make_llm(
        "served",
        batch_invariant=True,
        num_kv_blocks=32,
        speculative_method="suffix",
        num_speculative_tokens=8,
        suffix_cache_max_tokens=600,
    )
    engine = llm.engine
    assert engine.speculation.control is not None
    for _ in range(2):
        before = engine.stats().spec
        got = completions(llm.generate(prompts, params, use_tqdm=False))
        assert got == expected
        spec = engine.stats().spec
        print(
            f"accepted {spec.num_accepted_tokens - before.num_accepted_tokens} of "
            f"{spec.num_draft_tokens - before.num_draft_tokens}"
        )
    assert spec.num_accepted_tokens - before.num_accepted_tokens > 50
    memory = engine.speculation.host.memory()
    assert 0 < memory["cached_tokens"] <= 600 and memory["entries"] <= 600 * KEY


def set_step_times(control, buckets, seconds) -> None:
    """One request's step times as a device that runs each token bucket's padded shape gives
    them: every count of scheduled tokens its bucket's `seconds(bucket)`."""
    control.target.pop(1, None)
    costs = control.costs(1)
    for tokens in range(1, buckets[-1] + 1):
        costs.observe(tokens, seconds(next(b for b in buckets if b >= tokens)))


def test_adaptive_plans_follow_the_step_times(make_llm):
    """With the step times fixed: where a step's time grows with its tokens, only the
    padding of the smallest bucket (2 tokens: one proposal) is taken; free verifying takes
    more."""
    llm = make_llm("tiny", **(SPEC | {"speculative_adaptive": True}))
    control = llm.engine.speculation.control
    control.observe_step = lambda *args: None  # the times below, not measured ones
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    buckets = llm.engine.config.scheduler.token_buckets
    for seconds, most in ((lambda b: 0.01 * b, 1), (lambda b: 0.01, 8)):
        set_step_times(control, buckets, seconds)
        seen = record_draft_counts(llm)
        llm.generate(prompt, greedy, use_tqdm=False)
        llm.engine.scheduler.schedule = type(llm.engine.scheduler).schedule.__get__(
            llm.engine.scheduler
        )
        assert max(max(counts) for counts in seen) == most


def test_a_host_proposer_proposes_only_where_the_plan_takes_proposals(make_llm):
    """Planned by step times, n-gram lookups run only in steps whose plan (every request at
    its limit, proposing's time paid) takes some: none where a lookup costs more than the
    tokens it can gain (free verifying, slow proposing), and the outputs are the same."""
    llm = make_llm("tiny", **(SPEC | {"speculative_adaptive": True}))
    speculation = llm.engine.speculation
    control = speculation.control
    control.observe_step = lambda *args: None  # the times below, not measured ones
    control.observe_host = lambda *args: None
    calls = []
    propose = speculation.host.propose
    speculation.host.propose = lambda *args: calls.append(args) or propose(*args)
    prompt = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    buckets = llm.engine.config.scheduler.token_buckets
    set_step_times(control, buckets, lambda bucket: 0.01)
    outputs = []
    for per_request, proposes in ((1.0, False), (0.0, True)):
        control.host.seconds = {1: per_request}
        calls.clear()
        outputs.append(completions(llm.generate(prompt, greedy, use_tqdm=False)))
        assert bool(calls) == proposes
    assert outputs[0] == outputs[1]


def test_logprob_close_without_batch_invariance(make_llm, cases):
    prompts, params = cases
    greedy = [
        SamplingParams(temperature=0, max_tokens=p.max_tokens, logprobs=5, ignore_eos=True)
        for p in params[:16]
    ]
    plain = make_llm("tiny").generate(prompts[:16], greedy, use_tqdm=False)
    spec = make_llm("tiny", **SPEC).generate(prompts[:16], greedy, use_tqdm=False)
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        a, b = a.outputs[0], b.outputs[0]
        largest = check_logprobs_close(
            (a.token_ids, a.logprobs), (b.token_ids, b.logprobs), f"prompt {i}", atol=SPEC_ATOL
        )
        print(f"{i}: largest logprob difference {largest:.2e}")


def test_request_override_beyond_the_engine_is_refused(speculative, baseline):
    with pytest.raises(ValueError, match="at most the engine's 8"):
        speculative.generate([[5, 6]], SamplingParams(num_speculative_tokens=9), use_tqdm=False)
    with pytest.raises(ValueError, match="speculative decoding is off"):
        baseline.generate([[5, 6]], SamplingParams(num_speculative_tokens=2), use_tqdm=False)
    # 0 turns it off for the request: no proposals at all.
    before = speculative.engine.stats().spec.num_drafts
    speculative.generate(
        [[5, 6, 5, 6, 5, 6]],
        SamplingParams(temperature=0, max_tokens=12, num_speculative_tokens=0),
        use_tqdm=False,
    )
    assert speculative.engine.stats().spec.num_drafts == before


# -- the sampled distribution --------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias=BIAS),
        SamplingParams(
            temperature=1.3, top_k=4, top_p=0.9, max_tokens=3, ignore_eos=True, logit_bias=BIAS
        ),
    ],
    ids=["temperature", "top_k_top_p"],
)
def test_distribution_unchanged(make_llm, params, monkeypatch):
    plain = make_llm("tiny")
    spec = make_llm("tiny", **SPEC)
    reference = pairs(plain, params, range(NUM_SAMPLES))
    # A verifier that accepts every proposal: the test must see the bias.
    before = spec.engine.stats().spec
    with monkeypatch.context() as patch:
        patch.setattr(Scheduler, "_verify", accept_all)
        biased = pairs(spec, params, range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    assert homogeneity_pvalue(reference, biased) < 1e-6
    got = pairs(spec, params, range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    spec_stats = spec.engine.stats().spec
    accepted = spec_stats.num_accepted_tokens - before.num_accepted_tokens
    proposed = spec_stats.num_draft_tokens - before.num_draft_tokens
    assert accepted > NUM_SAMPLES // 8 and proposed > accepted
    pvalue = homogeneity_pvalue(reference, got)
    print(f"p = {pvalue:.3f}; {len(got)} pairs seen; proposed {proposed}, accepted {accepted}")
    assert pvalue > 1e-3
    # With the same seeds, the very same tokens.
    assert pairs(spec, params, range(200)) == pairs(plain, params, range(200))
