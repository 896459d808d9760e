"""Speculative decoding's host and device pieces against plain references: n-gram proposals
(brute force), the proposal-length policy, the sampler's rows after proposals (penalties as
if the proposals were output, numpy), the kept rows, and the Prometheus counters."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.execution.batch import SamplingMetadata
from jaxinfer.engine.execution.device_inputs import accepted_rows, record_sampled
from jaxinfer.engine.sampling.sampler import SamplerState, process_logits
from jaxinfer.engine.scheduling.stats import SpecStats
from jaxinfer.engine.speculation.ngram import NgramIndex
from jaxinfer.engine.speculation.state import COPYING_ACCEPTED, MAX_COOLDOWN, SpecState
from jaxinfer.layers.kv_cache import KVCacheFormat


def brute_force_proposal(tokens: list[int], count: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (n in [min_n, max_n]) found earlier, its latest occurrence, and what
    follows it in the sequence extended by its own continuation."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                extended = list(tokens)
                while len(extended) < len(tokens) + count:
                    extended.append(extended[end + 1 + len(extended) - len(tokens)])
                return extended[len(tokens) :]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    more=st.lists(st.integers(0, 4), max_size=10),
    count=st.integers(0, 8),
    lengths=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_ngram_proposals_match_brute_force(tokens, more, count, lengths):
    min_n, max_n = lengths[0], lengths[0] + lengths[1]
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)  # indexed incrementally: first the prefix, then the rest
    full = tokens + more
    assert index.propose(full, count) == brute_force_proposal(full, count, min_n, max_n)


def test_ngram_realigns_a_copy_after_an_edit():
    """Where no n-gram matches after a step that took a copy's proposals but replaced one of
    its tokens, the next proposal goes on with the copy: after the token the edit replaced,
    or after the one it chose where that token comes a few later (it left some out). Only a
    copy that has had REALIGN_AFTER tokens accepted goes on so (a chance match does not)."""
    text = list(range(10, 40))
    tokens = [*text, 10, 11, 12, 13]

    def copying() -> tuple[NgramIndex, list[int]]:  # a copy with 5 tokens accepted
        index = NgramIndex(3, 5)
        assert index.propose(tokens, 4) == [14, 15, 16, 17]
        accepted = [*tokens, 14, 15, 16, 17, 18]
        assert index.propose(accepted, 4) == [19, 20, 21, 22]
        return index, accepted

    cases = {  # the step's new tokens: the next proposal
        (19, 20, 99): [22, 23, 24, 25],  # 99 in place of 21
        (19, 20, 23): [24, 25, 26, 27],  # 21 and 22 left out
        (99,): [20, 21, 22, 23],  # 99 in place of 19
        (19, 50, 60): [],  # it left the copy before its last token: no guess
    }
    for new, expected in cases.items():
        index, accepted = copying()
        assert index.propose([*accepted, *new], 4) == expected, new
    # a guess that is itself edited goes on from where it was
    index, accepted = copying()
    assert index.propose([*accepted, 19, 20, 99], 4) == [22, 23, 24, 25]
    assert index.propose([*accepted, 19, 20, 99, 22, 98], 4) == [24, 25, 26, 27]
    # a copy with fewer accepted (2 here) is not gone on with; nor is there one at first
    index = NgramIndex(3, 5)
    index.propose(tokens, 4)
    assert index.propose([*tokens, 14, 15, 99], 4) == []
    assert NgramIndex(3, 5).propose([*tokens, 99], 4) == []


def test_ngram_arbitrates_between_a_copy_and_a_fresh_match_by_their_record():
    """After an edit where a fresh match (99 occurred before 50..53) and the copy gone on
    past it (realign) propose differently, the fresh match is proposed until the tokens that
    came after such a step have followed the copy further: then the copy is; and a request
    whose tokens followed the fresh match goes on proposing it."""
    prefix = [99, 50, 51, 52, 53, *range(10, 40)]

    def edited(index: NgramIndex) -> list[int]:
        tokens = [*prefix, 10, 11, 12, 13]
        assert index.propose(tokens, 4) == [14, 15, 16, 17]
        tokens += [14, 15, 16, 17, 18]
        assert index.propose(tokens, 4) == [19, 20, 21, 22]
        return [*tokens, 19, 20, 99]  # 99 in place of 21

    index = NgramIndex(1, 5)
    tokens = edited(index)
    assert index.propose(tokens, 4) == [50, 51, 52, 53]  # no record yet: the fresh match
    tokens += [22]  # the copy's token came
    assert index.propose(tokens, 4) == [23, 24, 25, 26]
    tokens += [23, 24, 25, 26, 27]
    assert index.propose(tokens, 4) == [28, 29, 30, 31]
    tokens += [28, 99]  # another edit, 99 in place of 29
    assert index.propose(tokens, 4) == [30, 31, 32, 33]  # the copy, by its record

    index = NgramIndex(1, 5)
    tokens = edited(index)
    assert index.propose(tokens, 4) == [50, 51, 52, 53]
    tokens += [50, 51]  # the fresh match's tokens came
    index.propose(tokens, 4)
    assert index.trust_copy < 0


def test_ngram_continues_a_loop_past_its_period():
    assert NgramIndex(1, 3).propose([5, 6, 7, 5, 6], 4) == [7, 5, 6, 7]
    assert NgramIndex(2, 2).propose([1, 2, 3], 2) == []


def test_proposal_length_policy():
    state = SpecState(limit=6)
    assert state.wanted() == 6
    state.record(6, 6)
    assert state.length == 6  # capped at the limit
    state.record(6, 3)
    assert state.length == 4  # half or more accepted: one past them
    state.record(4, 1)
    assert state.length == 2  # fewer than half: halved
    state.record(2, 0)
    state.record(1, 0)
    assert state.length == 0
    waits = []
    for _ in range(6):  # each back-off doubles the rest
        steps = 1
        while state.wanted() == 0:
            steps += 1
        waits.append(steps)
        state.record(1, 0)
    assert waits == [4, 8, 16, 32, 64, 64] and MAX_COOLDOWN == 64
    state.record(0, 0)  # no proposal found: nothing changes
    assert state.length == 0


def metadata(drafts, first_rows, keeps=None) -> SamplingMetadata:
    rows = len(drafts)
    base = SamplingMetadata.neutral(rows)
    made = SamplingMetadata(
        **{
            **base.__dict__,
            "repetition_penalty": np.full(rows, 1.5, np.float32),
            "frequency_penalty": np.full(rows, 0.5, np.float32),
            "presence_penalty": np.full(rows, 0.25, np.float32),
            "keeps": np.ones(rows, np.int32) if keeps is None else np.asarray(keeps, np.int32),
            "drafts": np.asarray(drafts, np.int32),
            "first_rows": np.asarray(first_rows, np.int32),
            "state_rows": np.asarray([0, 0, 0, 1, 1, 2], np.int32)[:rows],
        }
    )
    return jax.tree.map(jnp.asarray, made)


def test_rows_after_proposals_see_them_as_output():
    """Request A: rows 0-2 (proposals 4, 4), request B: rows 3-4 (proposal 7), C: row 5."""
    vocab = 12
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, vocab)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(3, vocab)).astype(np.int32)
    prompt = rng.random((3, vocab)) < 0.2
    state = SamplerState(
        output_counts=jnp.asarray(counts),
        prompt_mask=jnp.asarray(prompt),
        bias=jnp.zeros((3, vocab), jnp.float32),
        bitmask=jnp.full((3 * 3, 1), -1, jnp.int32),
    )
    md = metadata([4, 4, -1, 7, -1, -1], [0, 0, 0, 3, 3, 5])
    got = np.asarray(process_logits(jnp.asarray(logits), md, state, md.state_rows, 2))
    earlier = [[], [4], [4, 4], [], [7], []]
    for row in range(6):
        c = counts[int(md.state_rows[row])].copy()
        for token in earlier[row]:
            c[token] += 1
        seen = prompt[int(md.state_rows[row])] | (c > 0)
        x = logits[row].copy()
        x = np.where(seen, np.where(x > 0, x / 1.5, x * 1.5), x)
        x = x - 0.5 * c - 0.25 * (c > 0)
        np.testing.assert_allclose(got[row], x, rtol=1e-6, atol=1e-6, err_msg=f"row {row}")


def test_kept_rows_and_recorded_tokens():
    md = metadata([4, 4, -1, 7, -1, -1], [0, 0, 0, 3, 3, 5], keeps=[1, 1, 1, 1, 1, 0])
    # A: 4 matches, then 5 != 4: rows 0-1 kept. B: 9 != 7: row 3 kept. C: not kept.
    sampled = jnp.asarray([4, 5, 6, 9, 8, 2], jnp.int32)
    assert np.asarray(accepted_rows(sampled, md)).tolist() == [1, 1, 0, 1, 0, 0]
    state = SamplerState(
        output_counts=jnp.zeros((4, 12), jnp.int32),
        prompt_mask=jnp.zeros((4, 12), bool),
        bias=jnp.zeros((4, 12), jnp.float32),
        bitmask=jnp.zeros((4, 1), jnp.int32),
    )
    last, state = record_sampled(jnp.full(4, -1, jnp.int32), state, sampled, md)
    assert np.asarray(last).tolist() == [5, 9, -1, -1]  # each request's last kept token
    counts = np.asarray(state.output_counts)
    assert counts[0, 4] == 1 and counts[0, 5] == 1 and counts[1, 9] == 1 and counts.sum() == 3


def test_prometheus_counters():
    from jaxinfer.config.cache_specs import AttentionSpec
    from jaxinfer.config.engine_config import CacheConfig
    from jaxinfer.server.metrics import ServerMetrics

    spec = SpecStats()
    stats = types.SimpleNamespace(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_generated_tokens=0,
        spec=spec,
        cache_usage={},
        cache_capacity={},
    )
    engine = types.SimpleNamespace(
        config=types.SimpleNamespace(
            speculative=types.SimpleNamespace(method="ngram"),
            cache=CacheConfig(
                block_size=16,
                num_blocks=9,
                kv_format=KVCacheFormat.resolve("auto", "float32"),
                layer_specs=(AttentionSpec((0,)),),
            ),
        ),
        stats=lambda: stats,
        background_compile=None,
    )
    metrics = ServerMetrics(engine)
    spec.record(3, 2)
    spec.record(5, 0)
    stats.spec = spec.snapshot()
    text = metrics.render().decode()
    spec.record(1, 1)
    spec.proposing_seconds, spec.suffix_cache_entries = 0.25, 40
    stats.spec = spec.snapshot()
    text = metrics.render().decode()
    assert 'jaxinfer:spec_decode_method{method="ngram"} 1.0' in text
    assert "jaxinfer:spec_decode_proposing_seconds_total 0.25" in text
    assert "jaxinfer:spec_decode_suffix_cache_entries 40.0" in text
    assert "jaxinfer:spec_decode_num_drafts_total 3.0" in text
    assert 'jaxinfer:kv_cache_capacity_tokens{kv_cache_dtype="auto"} 128.0' in text
    assert "jaxinfer:spec_decode_num_draft_tokens_total 9.0" in text
    assert "jaxinfer:spec_decode_num_accepted_tokens_total 3.0" in text
    assert 'jaxinfer:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 2.0' in text
    assert 'jaxinfer:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text


@pytest.mark.slow  # (a chi-square over many draws; the engine's own runs in the engine lane)
def test_rejection_sampling_keeps_the_target_distribution():
    """Proposals drawn from a draft distribution q, verified against p: the tokens follow p
    (chi-square), a row returns its proposal exactly when it was accepted, and the accepted
    share is sum(min(p, q)); the check first rejects a verifier that keeps every proposal."""
    from scipy import stats as scipy_stats

    from jaxinfer.engine.sampling.sampler import rejection_sample, request_keys

    vocab, trials = 6, 20000
    rng = np.random.default_rng(1)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.1, 0.0])
    q = np.array([0.1, 0.3, 0.3, 0.05, 0.05, 0.2])
    drafts = rng.choice(vocab, size=trials, p=q).astype(np.int32)
    scaled = np.log(np.maximum(p, 1e-30)).astype(np.float32)
    scaled[p == 0] = -np.inf
    seeds = np.stack([np.arange(trials), np.zeros(trials)], axis=1).astype(np.uint32)
    keys = request_keys(jnp.asarray(seeds), jnp.zeros(trials, jnp.int32))
    tokens = np.asarray(
        rejection_sample(
            jnp.asarray(np.tile(scaled, (trials, 1))),
            jnp.asarray(np.tile(q, (trials, 1)).astype(np.float32)),
            jnp.asarray(drafts),
            keys,
        )
    )

    def pvalue(samples):
        observed = np.bincount(samples, minlength=vocab)[:5]
        return scipy_stats.chisquare(observed, p[:5] / p[:5].sum() * observed.sum()).pvalue

    assert pvalue(drafts[drafts < 5]) < 1e-6  # keeping every proposal: the draft's q
    assert pvalue(tokens) > 1e-3 and not np.any(tokens == 5)
    accepted = (tokens == drafts).mean()
    assert abs(accepted - np.minimum(p, q).sum()) < 0.02


def test_a_lookup_probe_makes_a_draft_request_copy_or_wait():
    """A probe with COPYING_ACCEPTED of its proposals accepted makes the request copy (the
    draft leaves it); fewer, and probes wait a cooldown that doubles each time."""
    state = SpecState(limit=8)
    waits = []
    for _ in range(6):
        state.lookup_probe = True
        state.record(8, COPYING_ACCEPTED - 1)
        assert not state.lookup_probe and not state.copying and not state.draft_off
        waits.append(state.probe_cooldown)
    assert waits == [4, 8, 16, 32, 64, MAX_COOLDOWN]
    state.record(8, 8)  # a draft's proposals: no probe
    assert not state.copying
    state.lookup_probe = True
    state.record(8, COPYING_ACCEPTED)
    assert state.copying and state.draft_off
