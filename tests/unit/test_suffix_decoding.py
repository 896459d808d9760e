"""Suffix decoding's trees against brute force over the same sequences."""

from __future__ import annotations

import collections
import random

import pytest

from jaxinfer.config import SpeculativeConfig
from jaxinfer.engine.speculation.ngram import NgramIndex
from jaxinfer.engine.speculation.suffix import RequestSuffix, SuffixProposer, SuffixTree


def substring_counts(sequences: list[list[int]], depth: int) -> collections.Counter:
    counts = collections.Counter()
    for tokens in sequences:
        for start in range(len(tokens)):
            for end in range(start + 1, min(start + depth, len(tokens)) + 1):
                counts[tuple(tokens[start:end])] += 1
    return counts


def tree_counts(tree: SuffixTree) -> collections.Counter:
    """Each substring's count, checking every node's sum and most frequent continuation."""
    counts, stack = collections.Counter(), [((), tree.root)]
    while stack:
        path, node = stack.pop()
        children = node.children or {}
        assert node.total == sum(child.count for child in children.values())
        if children:
            assert children[node.best].count == max(c.count for c in children.values())
        for token, child in (node.children or {}).items():
            counts[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return counts


def random_tokens(rng: random.Random, length: int, vocab: int = 4) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("seed", range(5))
def test_tree_counts_every_substring(seed):
    rng = random.Random(seed)
    depth = rng.randint(1, 7)
    sequences = [random_tokens(rng, rng.randint(0, 40)) for _ in range(3)]
    tree = SuffixTree(depth)
    for tokens in sequences:
        tree.add(tokens)
    expected = substring_counts(sequences, depth)
    assert tree_counts(tree) == expected
    assert tree.num_nodes == len(expected) + 1
    # Taking a sequence back leaves the others' counts, and no empty node.
    tree.remove(sequences[0])
    expected = substring_counts(sequences[1:], depth)
    assert tree_counts(tree) == expected and tree.num_nodes == len(expected) + 1


def test_request_tree_grows_as_tokens_arrive():
    rng = random.Random(0)
    tokens = random_tokens(rng, 60)
    grown = RequestSuffix(SuffixTree(6), NgramIndex(3, 5))
    for end in (1, 7, 8, 30, 60):  # tokens arrive a few at a time
        grown.extend(tokens[:end])
    whole = SuffixTree(6)
    whole.add(tokens)
    assert tree_counts(grown.tree) == tree_counts(whole)


@pytest.mark.parametrize("seed", range(10))
def test_match_is_the_longest_suffix_seen_with_a_continuation(seed):
    rng = random.Random(seed)
    tokens = random_tokens(rng, 50, vocab=3)
    tree = SuffixTree(8)
    tree.add(tokens)
    node, length = tree.match(tokens, 4)
    counts = substring_counts([tokens[:-1]], 8)  # substrings that some token follows
    want = max((m for m in range(1, 5) if counts[tuple(tokens[len(tokens) - m :])] > 0), default=0)
    assert length == want
    assert node is tree.root if want == 0 else node.children


def test_proposal_follows_the_most_frequent_continuation():
    tree = SuffixTree(16)
    tree.add([1, 2, 3, 4, 5, 6] * 3)  # "1 2 3 4 5 6" three times
    tree.add([9, 1, 2, 3, 7])  # once: 1 2 3 then 7
    proposal, score = tree.speculate([8, 1, 2, 3], most=10, min_token_prob=0.1, max_spec_factor=1)
    assert proposal == [4, 5, 6]  # 3 of 4 times; as long as the match (factor 1)
    assert score == pytest.approx(3 * 0.75)
    longer, _ = tree.speculate([8, 1, 2, 3], most=10, min_token_prob=0.1, max_spec_factor=3)
    assert longer[:4] == [4, 5, 6, 1]
    # A continuation that is a coin toss stops the proposal at the threshold.
    tree = SuffixTree(16)
    for last in range(5):
        tree.add([1, 2, 3, 4, last])
    proposal, _ = tree.speculate([1, 2, 3, 4], 10, min_token_prob=0.3, max_spec_factor=2)
    assert proposal == []
    proposal, _ = tree.speculate([1, 2, 3, 4], 10, min_token_prob=0.1, max_spec_factor=2)
    assert len(proposal) == 1


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


def test_server_tree_proposes_what_recent_outputs_said_and_stays_bounded():
    proposer = SuffixProposer(config())
    call = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # the shape of a tool call
    proposer.finished([1, *call])
    state = proposer.new_state(8)
    prompt = [40, 41, 42, 5, 6, 7, 8]  # never seen the call's tail itself
    assert proposer.propose(state, prompt, room=8) == [9, 10, 11, 12]  # factor 1: 4 matched
    rng = random.Random(0)
    for _ in range(50):
        proposer.finished(random_tokens(rng, rng.randint(1, 30), vocab=50))
    memory = proposer.memory()
    assert memory["cached_tokens"] <= 100
    assert memory["nodes"] <= 100 * 16 + 1
    assert memory["nodes"] == len(substring_counts(list(proposer.cached), 16)) + 1


def test_own_tokens_win_over_the_server_tree_when_they_score_higher():
    proposer = SuffixProposer(config())
    proposer.finished([1, 2, 3, 99])
    state = proposer.new_state(8)
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # own history says 4, twice
    assert proposer.propose(state, tokens, room=1) == [4]
    assert proposer.propose(state, tokens, room=0) == []


def test_a_copy_goes_on_past_an_edit_where_the_trees_propose_nothing():
    """The trees' proposal copies the request's text; after a step whose last token replaced
    one of it (a token they never saw, so they propose nothing), the copy goes on after the
    replaced token (NgramIndex.realign), as n-gram proposals do."""
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
