"""Speculative decoding with a draft model: a draft identical to the model accepts every
proposal (greedy, and at temperature 1, where q = p); another draft leaves greedy outputs
token for token those of decoding without it (batch_invariant; mixed parameters, grammars,
preemption, aborts), and the sampled distribution unchanged (chi-square, shown first to reject
a verifier that accepts every proposal). The engine refuses a draft of another vocabulary."""

from __future__ import annotations

import collections

import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import EngineOptions
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.engine.speculation.propose import DRAFT_PATIENCE, IDLE_AFTER, PROBE_EVERY
from tests.support.engines import build_llm
from tests.support.models import make_tiny_model
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

# (the rule of thumb: measured step times would make the proposals counted here vary; the
# draft's own proposals alone, but in the test of draft_prompt_lookup)
DRAFT = dict(
    speculative_method="draft",
    num_speculative_tokens=4,
    speculative_adaptive=False,
    draft_prompt_lookup=False,
)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A draft: the tiny model's shape and tokenizer, other random weights."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_draft"), seed=1)


@pytest.fixture(scope="module")
def baseline(make_llm):
    # (test_speculative's baseline engine; outputs do not depend on its sizes)
    return make_llm("tiny", batch_invariant=True, num_kv_blocks=20, max_num_seqs=8)


def spec_counts(llm, run) -> tuple[int, int]:
    """(proposed, accepted) during run()."""
    before = llm.engine.stats().spec
    run()
    after = llm.engine.stats().spec
    return (
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    )


def test_identical_draft_accepts_every_proposal(make_llm, tiny_model_dir, baseline):
    spec = make_llm("tiny", batch_invariant=True, draft_model=str(tiny_model_dir), **DRAFT)
    prompts, _ = prompts_and_params(12, seed=3)
    greedy = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    expected = completions(baseline.generate(prompts, greedy, use_tqdm=False))
    got = []
    proposed, accepted = spec_counts(
        spec, lambda: got.extend(completions(spec.generate(prompts, greedy, use_tqdm=False)))
    )
    assert got == expected
    assert proposed > 100 and accepted == proposed
    # The draft runs over a target step only where its own steps did not write the step's
    # K/V: one request's prompt chunks (16 tokens a step, fewer on a prefix-cache hit), not
    # its decode steps.
    draft, steps, extends = spec.engine.draft, [], []
    extend, execute = draft.extend, spec.engine.runner.execute
    draft.extend = lambda batch: extends.append(1) or extend(batch)
    spec.engine.runner.execute = lambda *args, **kw: steps.append(1) or execute(*args, **kw)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert completions(spec.generate(prompts[:1], long, use_tqdm=False)) == completions(
        baseline.generate(prompts[:1], long, use_tqdm=False)
    )
    draft.extend, spec.engine.runner.execute = extend, execute
    print(f"{len(extends)} extends in {len(steps)} steps")
    assert len(extends) <= -(-len(prompts[0]) // 16) and len(steps) - len(extends) >= 8
    # At temperature 1 the draft draws from q = p (the same logits, bit for bit under
    # batch_invariant, the same top-k/top-p), so min(1, p/q) = 1: every proposal kept.
    for extra in ({}, {"top_k": 20, "top_p": 0.9}):
        sampled = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True, **extra)
            for i in range(len(prompts))
        ]
        proposed, accepted = spec_counts(
            spec, lambda p=sampled: spec.generate(prompts, p, use_tqdm=False)
        )
        assert proposed > 100 and accepted == proposed, extra


@pytest.fixture(scope="module")
def other_draft(make_llm, other_model_dir):
    # A pool of 24 blocks that 4 requests running long outgrow: preemptions.
    return make_llm(
        "tiny",
        batch_invariant=True,
        num_kv_blocks=24,
        draft_model=str(other_model_dir),
        **DRAFT,
    )


def greedy_cases(count: int) -> tuple[list, list]:
    prompts, params = prompts_and_params(count)
    wanted = [p.num_speculative_tokens for p in params]
    return prompts, [
        SamplingParams(
            **{
                **p.__dict__,
                "temperature": 0.0,
                "n": 1,
                "num_speculative_tokens": None if k is None else min(k, 4),
            }
        )
        for p, k in zip(params, wanted, strict=True)
    ]


def test_greedy_outputs_unchanged_by_another_draft(other_draft, baseline):
    prompts, params = greedy_cases(40)
    expected = completions(
        baseline.generate(prompts, [without_override(p) for p in params], use_tqdm=False)
    )
    got = []
    proposed, accepted = spec_counts(
        other_draft,
        lambda: got.extend(completions(other_draft.generate(prompts, params, use_tqdm=False))),
    )
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not mismatched, f"{len(mismatched)} of {len(got)} differ: {mismatched}"
    print(f"proposed {proposed}, accepted {accepted}")
    assert proposed > 100 and 0 < accepted < proposed
    assert other_draft.engine.stats().num_preemptions > 0
    # Aborts midway free every block.
    engine = other_draft.engine
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(prompt, p, request_id=request_id)
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step in (3, 9, 20):
            for request_id in ids[step % 5 :: 5]:
                engine.abort_request(request_id)
        engine.step()
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"


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
def test_distribution_unchanged(make_llm, other_draft, params, monkeypatch):
    plain = make_llm("tiny")
    spec = other_draft
    reference = pairs(plain, params, range(NUM_SAMPLES))

    # A verifier that accepts every proposal: the tokens are then the draft's, from q.
    with monkeypatch.context() as patch:
        patch.setattr(Scheduler, "_verify", accept_all)
        biased = pairs(spec, params, range(NUM_SAMPLES, 2 * NUM_SAMPLES))
    assert homogeneity_pvalue(reference, biased) < 1e-6
    got = collections.Counter()
    proposed, accepted = spec_counts(
        spec,
        lambda: got.update(pairs(spec, params, range(NUM_SAMPLES, 2 * NUM_SAMPLES))),
    )
    assert accepted > NUM_SAMPLES // 4 and proposed > accepted
    pvalue = homogeneity_pvalue(reference, got)
    print(f"p = {pvalue:.3f}; proposed {proposed}, accepted {accepted}")
    assert pvalue > 1e-3


def test_a_draft_no_plan_pays_for_stops_running(tiny_model_dir, other_model_dir, baseline):
    """Where no plan takes a proposal, a request's draft steps (the catch-up of tokens it
    missed) stop after DRAFT_PATIENCE steps; once IDLE_AFTER requests in a row left the draft
    so, new requests start without it (not even their prompts run through it) but one in
    PROBE_EVERY. The tokens are those of decoding without a draft throughout."""
    spec = build_llm(
        tiny_model_dir, "tiny", batch_invariant=True, draft_model=str(other_model_dir), **DRAFT
    )
    scheduler = spec.engine.scheduler
    scheduler.plan_proposals = lambda used, n, wanted, draft_rows=0: [0] * len(wanted)
    draft = spec.engine.draft
    calls = collections.Counter()
    propose, extend = draft.propose, draft.extend
    draft.propose = lambda *args: calls.update(["propose"]) or propose(*args)
    draft.extend = lambda batch: calls.update(["extend"]) or extend(batch)
    prompts, _ = prompts_and_params(IDLE_AFTER + PROBE_EVERY, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = completions(baseline.generate(prompts, greedy, use_tqdm=False))
    runs = []
    for prompt, tokens in zip(prompts, expected, strict=True):  # one request at a time
        before = calls.copy()
        assert completions(spec.generate([prompt], greedy, use_tqdm=False)) == [tokens]
        runs.append((calls["propose"] - before["propose"], calls["extend"] - before["extend"]))
    print(runs)
    followed = runs[:IDLE_AFTER] + runs[-1:]  # (the last: the probe)
    assert all(0 < p < DRAFT_PATIENCE and e > 0 for p, e in followed)
    assert all(run == (0, 0) for run in runs[IDLE_AFTER:-1])


def test_the_draft_runs_over_the_requests_it_follows_alone(
    tiny_model_dir, other_model_dir, baseline
):
    """Requests the draft does not follow (here: all but the first, started without it) are
    left out of its runs over a step's prompt chunks: each batch it extends holds the first
    request's tokens alone, in a bucket of their size, and it still proposes for that one.
    The tokens are those of decoding without a draft."""
    import jax

    spec = build_llm(
        tiny_model_dir, "tiny", batch_invariant=True, draft_model=str(other_model_dir), **DRAFT
    )
    speculation, draft = spec.engine.speculation, spec.engine.draft
    states, batches, calls = [], [], collections.Counter()
    new_state, extend, propose = speculation.new_state, draft.extend, draft.propose

    def started(requested):
        state = new_state(requested)
        state.draft_off = bool(states)  # (the first request alone is followed)
        return states.append(state) or state

    speculation.new_state = started
    draft.extend = lambda batch: batches.append(jax.device_get(batch)) or extend(batch)
    draft.propose = lambda *args: calls.update(["propose"]) or propose(*args)
    prompts = [[5, 6, 7] * 9, [11, 12] * 17, [40 + i for i in range(30)]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = completions(baseline.generate(prompts, greedy, use_tqdm=False))
    assert completions(spec.generate(prompts, greedy, use_tqdm=False)) == expected
    assert batches and calls["propose"] > 0
    tokens = []
    for batch in batches:
        assert int(batch.num_seqs[0]) == 1
        count = int(batch.query_start_loc[1])
        assert spec.engine.batch_builder.bucket(count) == len(batch.token_ids)
        tokens += batch.token_ids[:count].tolist()
    assert tokens[: len(prompts[0])] == prompts[0]


def test_a_request_that_copies_proposes_by_lookup(tiny_model_dir, other_model_dir, baseline):
    """draft_prompt_lookup: a request whose last prompt_lookup_max tokens occurred in its
    prompt tries lookup's proposals for a step (the draft extended over them); accepted, it
    copies from then on, proposing by lookup alone, the draft leaving it. Its tokens, and
    those of requests the draft goes on following beside it, are those of decoding without
    speculation. (The tiny model copies where its prompt holds the start of its own greedy
    output, which falls into runs of one token.)"""
    options = {**DRAFT, "draft_prompt_lookup": True}
    spec = build_llm(
        tiny_model_dir, "tiny", batch_invariant=True, draft_model=str(other_model_dir), **options
    )
    engine = spec.engine
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    starts = [[5, 6, 7, 8, 9, 10], [40 + i for i in range(20)], [11, 12, 13, 14, 15]]
    own = [list(o.outputs[0].token_ids) for o in baseline.generate(starts, greedy, use_tqdm=False)]
    # the first ends in the start of a run of one token its greedy output goes on with
    prompts = [starts[2] + own[2][:12], starts[1], starts[0] + own[0][:12]]
    expected = [
        list(o.outputs[0].token_ids) for o in baseline.generate(prompts, greedy, use_tqdm=False)
    ]
    ids = [f"copy-{i}" for i in range(len(prompts))]
    states, outputs = {}, {}

    def step():
        for request in engine.scheduler.running:
            states[request.request_id] = request.spec
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)

    # the first alone until it has decoded a few tokens (its probe's step has room), then
    # the others beside it
    engine.add_request(prompts[0], greedy, request_id=ids[0])
    for _ in range(4):
        step()
    for request_id, prompt in zip(ids[1:], prompts[1:], strict=True):
        engine.add_request(prompt, greedy, request_id=request_id)
    while engine.has_unfinished_requests():
        step()
    assert [outputs[i] for i in ids] == expected
    copying = [i for i in ids if states[i].copying]
    print(f"copying: {copying}; {engine.stats().spec}")
    # (the others' outputs repeat runs of their own, not of their prompts)
    assert copying == ids[:1] and states[ids[0]].draft_off


def test_draft_options_are_checked(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="needs a draft_model"):
        EngineOptions(speculative_method="draft")
    with pytest.raises(ValueError, match="only used with speculative_method draft"):
        EngineOptions(draft_model=str(tiny_model_dir))
    other_vocab = make_tiny_model(tmp_path / "vocab", vocab_size=256)
    with pytest.raises(ValueError, match="must have the model's vocabulary"):
        build_llm(tiny_model_dir, "tiny", draft_model=str(other_vocab), **DRAFT)
