"""Suffix decoding's indexes against brute force over the same sequences."""

from __future__ import annotations

import collections
import random

import pytest

from jaxinfer.config import SpeculativeConfig
from jaxinfer.engine.speculation.ngram import NgramIndex
from jaxinfer.engine.speculation.suffix import (
    KEY,
    RECENT,
    RequestSuffix,
    SuffixIndex,
    SuffixProposer,
)


def brute_speculate(sequences, tokens, most, min_token_prob, max_spec_factor, depth):
    """A suffix tree's proposal, from its definition: the longest suffix of `tokens` (at most
    depth // 2) that occurs in a sequence with a continuation, followed by the most frequent
    next token of its occurrences (a tie to the latest) while the path's probability stays at
    or above min_token_prob, for at most max_spec_factor x its length tokens and to the
    depth."""
    for length in range(min(depth // 2, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - length :]
        ends = [
            (index, end)
            for index, sequence in enumerate(sequences)
            for end in range(length - 1, len(sequence) - 1)
            if sequence[end - length + 1 : end + 1] == suffix
        ]
        if ends:
            break
    else:
        return [], 0.0
    ends.sort(reverse=True)  # latest first
    most = min(most, int(max_spec_factor * length + 0.5), depth - length)
    proposal, probability, score = [], 1.0, 0.0
    while len(proposal) < most:
        ahead = len(proposal) + 1
        nexts = [sequences[i][end + ahead] for i, end in ends if end + ahead < len(sequences[i])]
        if not nexts:
            break
        counts = collections.Counter(nexts)
        token = max(counts, key=lambda t: (counts[t], -nexts.index(t)))
        probability *= counts[token] / len(nexts)
        if probability < min_token_prob:
            break
        proposal.append(token)
        score += probability
        ends = [
            (i, end)
            for i, end in ends
            if end + ahead < len(sequences[i]) and sequences[i][end + ahead] == token
        ]
    return proposal, score


def speculate(index: SuffixIndex, tokens, *limits, **named):
    """(proposal, score): the continuation of the longest suffix of `tokens` found (at most
    half the index's depth), as SuffixProposer asks each index."""
    return index.continuation(*index.match(tokens, index.depth // 2), *limits, **named)


def check_entries(index: SuffixIndex) -> None:
    """The index's count of entries, each held position stored, no empty n-gram."""
    assert index.num_entries == sum(len(ends) for ends in index.ends.values())
    for key, ends in index.ends.items():
        assert ends and len(ends) <= RECENT and 1 <= len(key) <= KEY
        assert all(index.offset <= end < index.stop for end in ends)
        for end in ends:
            assert [index.token(end - len(key) + 1 + i) for i in range(len(key))] == list(key)


def random_tokens(rng: random.Random, length: int, vocab: int = 4) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("seed", range(30))
def test_proposals_are_a_suffix_trees(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 4, 6, 8, 12, 16])
    sequences = [random_tokens(rng, rng.randint(0, 40), vocab=rng.choice([3, 5])) for _ in range(3)]
    index = SuffixIndex(depth)
    for tokens in sequences:
        index.add(tokens)
    check_entries(index)
    for _ in range(10):
        tokens = random_tokens(rng, rng.randint(1, 12), vocab=5)
        source = rng.choice(sequences)
        if source and rng.random() < 0.5:  # (a long match: a piece of a sequence)
            start = rng.randrange(len(source))
            tokens = source[start : start + rng.randint(1, 12)]
        args = (tokens, rng.randint(1, 10), rng.choice([0.0, 0.1, 0.4]), rng.choice([0.5, 1, 3]))
        got, score = speculate(index, *args)
        want, want_score = brute_speculate(sequences, *args, depth)
        assert got == want
        assert score == pytest.approx(want_score)
    # (no n-gram occurs more than RECENT times here: the counts are the tree's)
    assert max(len(ends) for ends in index.ends.values()) < RECENT


@pytest.mark.parametrize("seed", range(10))
def test_own_index_grows_as_tokens_arrive(seed):
    rng = random.Random(seed)
    tokens = random_tokens(rng, 60)
    grown = RequestSuffix(SuffixIndex(8), NgramIndex(3, 5))
    for end in (1, 7, 8, 30, 60):  # tokens arrive a few at a time
        grown.extend(tokens[:end])
        got = speculate(grown.own, tokens[:end], 6, 0.1, 2)
        want = brute_speculate([tokens[:end]], tokens[:end], 6, 0.1, 2, 8)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1])
    whole = SuffixIndex(8)
    whole.extend(tokens)
    assert grown.own.ends == whole.ends and grown.own.store == tokens
    check_entries(grown.own)


def test_an_ngram_keeps_its_latest_occurrences():
    index = SuffixIndex(16)
    index.add([7, 1] * 100)  # "7 1" and "1 7": 100 and 99 times
    assert list(index.ends[(7,)]) == list(range(200 - 2 * RECENT, 200, 2))
    check_entries(index)
    assert index.num_entries < 200 * KEY


def test_proposal_follows_the_most_frequent_continuation():
    index = SuffixIndex(16)
    index.add([1, 2, 3, 4, 5, 6] * 3)  # "1 2 3 4 5 6" three times
    index.add([9, 1, 2, 3, 7])  # once: 1 2 3 then 7
    proposal, score = speculate(index, [8, 1, 2, 3], most=10, min_token_prob=0.1, max_spec_factor=1)
    assert proposal == [4, 5, 6]  # 3 of 4 times; as long as the match (factor 1)
    assert score == pytest.approx(3 * 0.75)
    longer, _ = speculate(index, [8, 1, 2, 3], most=10, min_token_prob=0.1, max_spec_factor=3)
    assert longer[:4] == [4, 5, 6, 1]
    # A continuation that is a coin toss stops the proposal at the threshold.
    index = SuffixIndex(16)
    for last in range(5):
        index.add([1, 2, 3, 4, last])
    proposal, _ = speculate(index, [1, 2, 3, 4], 10, min_token_prob=0.3, max_spec_factor=2)
    assert proposal == []
    proposal, _ = speculate(index, [1, 2, 3, 4], 10, min_token_prob=0.1, max_spec_factor=2)
    assert proposal == [4]  # (a five-way tie: the latest)


def config(**overrides) -> SpeculativeConfig:
    fields = dict(
        method="suffix",
        num_speculative_tokens=8,
        prompt_lookup_min=1,
        prompt_lookup_max=1,
        suffix_max_depth=16,
        suffix_cache_max_tokens=100,
        suffix_min_token_prob=0.1,
        suffix_max_spec_factor=1.0,
    )
    return SpeculativeConfig(**(fields | overrides))


def test_server_index_proposes_what_recent_outputs_said_and_stays_bounded():
    proposer = SuffixProposer(config())
    call = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # the shape of a tool call
    proposer.finished([1, *call])
    state = proposer.new_state(8)
    prompt = [40, 41, 42, 5, 6, 7, 8]  # never seen the call's tail itself
    assert proposer.propose(state, prompt, room=8) == [9, 10, 11, 12]  # factor 1: 4 matched
    rng = random.Random(0)
    outputs = [random_tokens(rng, rng.randint(1, 30), vocab=50) for _ in range(50)]
    for output in outputs:
        proposer.finished(output)
    memory = proposer.memory()
    assert memory["cached_tokens"] <= 100
    kept = outputs[-memory["cached_outputs"] :]
    assert memory["cached_tokens"] == sum(map(len, kept))
    assert memory["entries"] == sum(
        max(len(output) - n + 1, 0) for output in kept for n in range(1, KEY + 1)
    )
    check_entries(proposer.cache)
    fresh = SuffixIndex(16)  # what it holds is what the kept outputs alone make
    for output in kept:
        fresh.add(output)
    assert {k: list(v) for k, v in fresh.ends.items()} == {
        k: [e - proposer.cache.offset for e in v] for k, v in proposer.cache.ends.items()
    }
    tokens = kept[-1][:5]
    assert speculate(proposer.cache, tokens, 8, 0.1, 2) == speculate(fresh, tokens, 8, 0.1, 2)
    proposer.forget()  # (LLMEngine.reset_prefix_cache)
    assert proposer.memory() == {"cached_outputs": 0, "cached_tokens": 0, "entries": 0}
    assert speculate(proposer.cache, tokens, 8, 0.1, 2) == ([], 0.0)
    proposer.finished([1, *call])  # and it learns again
    assert proposer.propose(proposer.new_state(8), prompt, room=8) == [9, 10, 11, 12]


def test_own_tokens_win_over_the_server_index_when_they_score_higher():
    proposer = SuffixProposer(config())
    proposer.finished([1, 2, 3, 99])
    state = proposer.new_state(8)
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # own history says 4, twice
    assert proposer.propose(state, tokens, room=1) == [4]
    assert proposer.propose(state, tokens, room=0) == []


def test_a_copy_goes_on_past_an_edit_where_the_indexes_propose_nothing():
    """The indexes' proposal copies the request's text; after a step whose last token
    replaced one of it (a token they never saw, so they propose nothing), the copy goes on
    after the replaced token (NgramIndex.realign), as n-gram proposals do."""
    proposer = SuffixProposer(config(prompt_lookup_min=3, prompt_lookup_max=5))
    state = proposer.new_state(4)
    tokens = [*range(10, 40), *range(10, 20)]  # a text, then the start of its copy
    assert proposer.propose(state, tokens, room=8) == [20, 21, 22, 23]
    tokens += [20, 21, 22, 23, 24]  # all accepted
    assert proposer.propose(state, tokens, room=8) == [25, 26, 27, 28]
    edited = [*tokens, 25, 99]  # 25 accepted, 99 in place of 26
    assert proposer.propose(state, edited, room=8) == [27, 28, 29, 30]
    fresh = proposer.new_state(4)  # (no copy before it: nothing to go on with)
    assert proposer.propose(fresh, edited, room=8) == []


def test_a_proposal_from_the_own_text_is_the_copy_realign_goes_on_with():
    """A proposal the request's own index made from a match shorter than prompt_lookup_min
    (one token here, so its n-grams find nothing) is still kept as the copy that goes on
    past an edit (NgramIndex.realign): where it began in the request's tokens."""
    proposer = SuffixProposer(config(prompt_lookup_min=3, prompt_lookup_max=5))
    state = proposer.new_state(4)
    tokens = [*range(10, 40), 50, 51, 25]  # 25: once in the text, followed by 26
    assert proposer.propose(state, tokens, room=8) == [26]
    assert state.index.lookup.copied_from == 16  # (26's position)


def test_a_guess_from_a_short_match_has_evidence_of_its_own():
    """A proposal after a match shorter than prompt_lookup_min is weak: its rejection lowers
    the acceptance weak proposals are planned with, not that of a long match's copy, and
    never makes the request rest; a copy after a long match is planned with the evidence of
    long matches."""
    proposer = SuffixProposer(config(prompt_lookup_min=3, prompt_lookup_max=5))
    state = proposer.new_state(4)
    text = [*range(10, 40)]
    guess = [*text, 50, 51, 25]  # 25: a one-token match, followed by 26 in the text
    assert proposer.propose(state, guess, room=8) == [26]
    assert state.weak
    for _ in range(6):  # rejected again and again
        state.record(1, 0)
        assert proposer.propose(state, guess, room=8) == [26] and state.weak
    assert state.acceptance < 0.2
    proposer.index(state, guess)  # (a step's proposing starts: no proposal yet)
    assert not state.weak and state.acceptance == pytest.approx(0.5)  # (the prior)
    assert state.length == 4 and state.wanted() == 4  # (not resting)
    copy = [*guess, 77, *range(10, 16)]  # a six-token match: the text's copy
    assert proposer.propose(state, copy, room=8) == [16, 17, 18, 19]
    assert not state.weak and state.acceptance == pytest.approx(0.5)
