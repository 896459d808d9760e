"""Suffix decoding (after Arctic Inference's SuffixDecoding): proposals from suffix trees over
the request's own tokens and over recent requests' outputs.

A SuffixTree holds every substring of up to `depth` tokens of the sequences added to it, as
paths from its root, each node counting the occurrences of its substring. To propose after a
request's tokens, the longest suffix of them found in a tree (a binary search: every suffix of
a substring is one too, and so continues wherever it does) is followed by its most frequent continuation, token by token, while
the product of the continuation's frequencies (child count / parent count) stays at or above
`min_token_prob`, for at most `max_spec_factor` x the match's length tokens: a long match
that always went the same way proposes far, a short or ambiguous one little. Two trees are
asked, the request's own (its prompt and output, grown as tokens arrive) and the server's
(the outputs of recently finished requests, at most `cache_max_tokens` tokens of them, oldest
evicted first), and the proposal with the larger score (the sum of its tokens' path
probabilities) wins. Where neither proposes anything, a copy of the request's own text that
the last proposal made goes on past an edit (jaxinfer.engine.speculation.ngram's realign).

Proposals are verified like n-gram proposals (jaxinfer.engine.speculation.ngram), so outputs
are exactly those of decoding without them. The server's tree is shared by every request:
what it holds changes only how fast another request's tokens come, never which.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.config import SpeculativeConfig
from jaxinfer.engine.speculation.ngram import NgramIndex
from jaxinfer.engine.speculation.state import SpecState


class Node:
    """A substring: its count, its continuations (children by token), the sum of their
    counts and the most frequent one (kept as counts change, so a proposal's step costs
    the same however many continuations a node has)."""

    __slots__ = ("best", "children", "count", "total")

    def __init__(self):
        self.children: dict[int, Node] | None = None
        self.count = 0
        self.total = 0  # the children's counts
        self.best = -1  # the token of the child with the largest count (-1: none)

    def child(self, token: int) -> Node:
        """The child for `token`, made if missing (counted by the caller)."""
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = Node()
        return node

    def counted(self, token: int, child: Node) -> None:
        """`child` (for `token`) was counted once more."""
        self.total += 1
        if self.best < 0 or child.count > self.children[self.best].count:
            self.best = token

    def uncounted(self, token: int) -> None:
        """The child for `token` was counted once less (and deleted at 0)."""
        self.total -= 1
        if token == self.best:
            self.best = max(self.children, key=lambda t: self.children[t].count, default=-1)


class SuffixTree:
    """Every substring of up to `depth` tokens of the sequences added, with its count."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()
        self.num_nodes = 1

    def grow(self, active: list[Node], token: int) -> list[Node]:
        """Extends by `token` the substrings ending at a sequence's last token (`active`: their
        nodes, longest first, at most depth - 1 of them) and counts each new substring;
        returns the nodes of the substrings that now end at `token`, longest first."""
        grown = []
        for node in [*active, self.root]:
            before = node.children is not None and token in node.children
            child = node.child(token)
            self.num_nodes += not before
            child.count += 1
            node.counted(token, child)
            grown.append(child)
        return grown[-(self.depth - 1) :] if self.depth > 1 else []

    def add(self, tokens: list[int]) -> None:
        active: list[Node] = []
        for token in tokens:
            active = self.grow(active, token)

    def remove(self, tokens: list[int]) -> None:
        """Takes back a sequence add() counted (its substrings' counts; nodes left at 0
        are deleted)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= _size(child)
                node.uncounted(token)
                if child.count == 0:
                    break
                node = child

    def find(self, pattern: list[int]) -> Node | None:
        node = self.root
        for token in pattern:
            if node.children is None or (node := node.children.get(token)) is None:
                return None
        return node

    def match(self, tokens: list[int], longest: int) -> tuple[Node, int]:
        """The node of the longest suffix of `tokens` (at most `longest`) that occurs in the
        tree with a continuation (not only at the end of a sequence, as the request's own
        current suffix does), and its length (0: the root)."""
        low, high, best = 1, min(longest, len(tokens)), (self.root, 0)
        while low <= high:
            middle = (low + high) // 2
            node = self.find(tokens[len(tokens) - middle :])
            if node is None or not node.children:
                high = middle - 1
            else:
                best, low = (node, middle), middle + 1
        return best

    def speculate(
        self, tokens: list[int], most: int, min_token_prob: float, max_spec_factor: float
    ) -> tuple[list[int], float]:
        """(proposal, score): the most frequent continuation of the longest suffix found."""
        node, length = self.match(tokens, self.depth // 2)
        most = min(most, int(max_spec_factor * length + 0.5))
        proposal, probability, score = [], 1.0, 0.0
        while len(proposal) < most and node.children:
            token = node.best
            child = node.children[token]
            probability *= child.count / node.total
            if probability < min_token_prob:
                break
            proposal.append(token)
            score += probability
            node = child
        return proposal, score


def _size(node: Node) -> int:
    stack, size = [node], 0
    while stack:
        node = stack.pop()
        size += 1
        if node.children:
            stack.extend(node.children.values())
    return size


@dataclasses.dataclass
class RequestSuffix:
    """A request's own tree, grown as its tokens arrive, and its n-gram index, which goes on
    with a copy past an edit where the trees propose nothing (NgramIndex.realign)."""

    tree: SuffixTree
    lookup: NgramIndex
    active: list[Node] = dataclasses.field(default_factory=list)
    num_added: int = 0

    def extend(self, tokens: list[int]) -> None:
        for token in tokens[self.num_added :]:
            self.active = self.tree.grow(self.active, token)
        self.num_added = len(tokens)


class SuffixProposer:
    """Suffix decoding's proposals (see the module docstring) and the server's tree."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.cache = SuffixTree(config.suffix_max_depth)
        self.cached: collections.deque[list[int]] = collections.deque()  # oldest first
        self.cached_tokens = 0

    def new_state(self, limit: int) -> SpecState:
        config = self.config
        lookup = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        return SpecState(
            limit=limit, index=RequestSuffix(SuffixTree(config.suffix_max_depth), lookup)
        )

    def propose(self, state: SpecState, tokens: list[int], room: int) -> list[int]:
        """Up to the request's limit of proposals (at most `room`) after `tokens`, unless
        it rests (SpecState)."""
        count = state.proposals(room)
        state.index.extend(tokens)
        if count <= 0:
            return []
        config = self.config
        args = (tokens, count, config.suffix_min_token_prob, config.suffix_max_spec_factor)
        own, own_score = state.index.tree.speculate(*args)
        cached, cached_score = self.cache.speculate(*args)
        proposed = own if own_score >= cached_score else cached
        lookup = state.index.lookup
        if not proposed:
            return lookup.realigned(tokens, count)
        lookup.note(tokens, proposed)
        return proposed

    def finished(self, output_token_ids: list[int]) -> None:
        """Adds a finished request's output to the server's tree, evicting the oldest outputs
        past suffix_cache_max_tokens."""
        limit = self.config.suffix_cache_max_tokens
        if not output_token_ids or len(output_token_ids) > limit:
            return
        self.cache.add(output_token_ids)
        self.cached.append(list(output_token_ids))
        self.cached_tokens += len(output_token_ids)
        while self.cached_tokens > limit:
            oldest = self.cached.popleft()
            self.cache.remove(oldest)
            self.cached_tokens -= len(oldest)

    def memory(self) -> dict[str, int]:
        """The server's tree: outputs and tokens held, and its nodes."""
        return {
            "cached_outputs": len(self.cached),
            "cached_tokens": self.cached_tokens,
            "nodes": self.cache.num_nodes,
        }
