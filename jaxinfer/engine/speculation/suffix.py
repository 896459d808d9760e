"""Suffix decoding (after Arctic Inference's SuffixDecoding): proposals from the request's own
tokens and from recent requests' outputs.

A SuffixIndex holds sequences of tokens and, for each n-gram of up to KEY tokens, where its
latest RECENT occurrences end. To propose after a request's tokens, the longest suffix of
them (at most half of `suffix_max_depth` tokens) that occurs with a continuation is found: the
longest n-gram suffix indexed, then each of its occurrences extended backwards token by
token. Its occurrences are followed by their most frequent continuation, token by token
(a tie goes to the latest occurrence), while the product of the continuation's frequencies
(the occurrences that go on with the token / those that go on at all) stays at or above
`min_token_prob`, for at most `max_spec_factor` x the match's length tokens (and to the
depth): a long match that always went the same way proposes far, a short or ambiguous one
little. These are the proposals of a suffix tree of depth `suffix_max_depth` over the same
sequences, with each n-gram's counts taken over its latest RECENT occurrences; the index costs
KEY entries per token where a tree makes up to the depth's nodes, a Python object each.

Two indexes are asked, the request's own (its prompt and output, grown as tokens arrive) and
the server's (the outputs of recently finished requests, at most `cache_max_tokens` tokens of
them, oldest evicted first), and the proposal with the larger score (the sum of its tokens'
path probabilities) wins. Where neither proposes anything, or where a copy of the request's
own text that the last proposal made goes on past an edit and has done better than the
indexes' proposals before, the copy is proposed (jaxinfer.engine.speculation.ngram's
realign and arbitrate: a short match after an edit proposes few tokens, the copy many).

Proposals are verified like n-gram proposals (jaxinfer.engine.speculation.ngram), so outputs
are exactly those of decoding without them. The server's index is shared by every request:
what it holds changes only how fast another request's tokens come, never which.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from jaxinfer.config import SpeculativeConfig
from jaxinfer.engine.speculation.ngram import NgramIndex
from jaxinfer.engine.speculation.state import SpecState

KEY = 4  # the longest n-gram indexed (a longer match extends a KEY-gram's occurrences)
RECENT = 64  # occurrences kept per n-gram, the latest
SEPARATOR = -1  # ends each sequence in the store (no token: a match or proposal stops there)


class SuffixIndex:
    """Sequences of tokens in one store (each followed by SEPARATOR but the one still
    growing), and where the latest RECENT occurrences of each of their n-grams (n <= KEY,
    within a sequence) end, as positions that count from the first token ever stored: the
    oldest sequences are evicted from the front (drop_oldest)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.store: list[int] = []
        self.offset = 0  # the position of store[0]
        self.begin = 0  # the position where the sequence still growing began
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its latest ends, ascending
        self.num_entries = 0  # positions held in `ends`

    @property
    def stop(self) -> int:
        """One past the last position stored."""
        return self.offset + len(self.store)

    def token(self, position: int) -> int:
        """The token at `position`, SEPARATOR past the store either way."""
        index = position - self.offset
        return self.store[index] if 0 <= index < len(self.store) else SEPARATOR

    def extend(self, tokens: list[int]) -> None:
        """Appends `tokens` to the sequence still growing, indexing their n-grams."""
        store, ends, offset = self.store, self.ends, self.offset
        for token in tokens:
            store.append(token)
            end = len(store) - 1
            for start in range(max(self.begin - offset, end - KEY + 1), end + 1):
                key = tuple(store[start : end + 1])
                occurrences = ends.get(key)
                if occurrences is None:
                    ends[key] = [end + offset]
                    self.num_entries += 1
                    continue
                occurrences.append(end + offset)
                if len(occurrences) > RECENT:
                    del occurrences[0]
                else:
                    self.num_entries += 1

    def close(self) -> None:
        """Ends the sequence still growing: the next tokens start another."""
        self.store.append(SEPARATOR)
        self.begin = self.stop

    def add(self, tokens: list[int]) -> None:
        self.extend(tokens)
        self.close()

    def drop_oldest(self, count: int) -> None:
        """Evicts the oldest `count` stored positions (whole sequences with their separators)
        and their n-grams' occurrences."""
        cut = self.offset + count
        keys = {
            tuple(self.store[start : end + 1])
            for end in range(count)
            for start in range(max(0, end - KEY + 1), end + 1)
            if SEPARATOR not in self.store[start : end + 1]
        }
        for key in keys:
            occurrences = self.ends.get(key)
            stale = bisect.bisect_left(occurrences, cut)
            self.num_entries -= stale
            if stale == len(occurrences):
                del self.ends[key]
            else:
                del occurrences[:stale]
        del self.store[:count]
        self.offset = cut

    def match(self, tokens: list[int], longest: int) -> tuple[list[int], int]:
        """(ends, length): the longest suffix of `tokens` (at most `longest`) that occurs with
        a continuation, its length (0: none) and where in the store its occurrences end
        (among its KEY-gram suffix's latest RECENT), latest first."""
        store, size, offset = self.store, len(self.store), self.offset
        longest = min(longest, len(tokens))
        for n in range(min(KEY, longest), 0, -1):
            occurrences = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if occurrences:
                ends = [
                    i
                    for end in reversed(occurrences)
                    if (i := end - offset) + 1 < size and store[i + 1] != SEPARATOR
                ]
                if ends:
                    break
        else:
            return [], 0
        if n < KEY or longest == KEY:
            return ends, n
        best, kept = n, []
        for i in ends:
            length = n
            while length < longest and i >= length and store[i - length] == tokens[-1 - length]:
                length += 1
            if length > best:
                best, kept = length, [i]
            elif length == best:
                kept.append(i)
        return kept, best

    def source(self, ends: list[int], proposal: list[int]) -> int | None:
        """Where the latest of a match's occurrences (`ends`, as `match`) that goes on with
        `proposal` ends: the copy a proposal of `continuation` made (None: none, or no
        proposal)."""
        if not proposal:
            return None
        size = len(proposal)
        found = (i for i in ends if self.store[i + 1 : i + 1 + size] == proposal)
        return next((i + self.offset for i in found), None)

    def continuation(
        self,
        ends: list[int],
        length: int,
        most: int,
        min_token_prob: float,
        max_spec_factor: float,
    ) -> tuple[list[int], float]:
        """(proposal, score) after a match of `length` tokens whose occurrences end at
        `ends` (as `match`)."""
        most = min(most, int(max_spec_factor * length + 0.5), self.depth - length)
        store, size = self.store, len(self.store)
        proposal, probability, score = [], 1.0, 0.0
        while len(proposal) < most:
            ahead = len(proposal) + 1
            if len(ends) == 1:  # (it goes on as its one occurrence did, to the separator)
                rest = store[ends[0] + ahead : ends[0] + 1 + most]
                if SEPARATOR in rest:
                    rest = rest[: rest.index(SEPARATOR)]
                proposal += rest
                score += probability * len(rest)
                break
            nexts = [store[i + ahead] if i + ahead < size else SEPARATOR for i in ends]
            counts: dict[int, int] = {}
            for token in nexts:  # (latest first: a tie goes to the latest)
                if token != SEPARATOR:
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            probability *= counts[token] / sum(counts.values())
            if probability < min_token_prob:
                break
            proposal.append(token)
            score += probability
            ends = [i for i, following in zip(ends, nexts, strict=True) if following == token]
        return proposal, score


@dataclasses.dataclass
class RequestSuffix:
    """A request's own index, grown as its tokens arrive, and its n-gram index, which goes
    on with a copy past an edit (NgramIndex.arbitrate)."""

    own: SuffixIndex
    lookup: NgramIndex

    def extend(self, tokens: list[int]) -> None:
        self.own.extend(tokens[self.own.stop :])


class SuffixProposer:
    """Suffix decoding's proposals (see the module docstring) and the server's index."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.forget()

    def new_state(self, limit: int) -> SpecState:
        config = self.config
        lookup = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        return SpecState(
            limit=limit, index=RequestSuffix(SuffixIndex(config.suffix_max_depth), lookup)
        )

    def index(self, state: SpecState, tokens: list[int]) -> None:
        """Indexes the request's tokens not indexed yet (its own index and its n-grams); the
        step's proposing starts here (no proposal made yet: none weak)."""
        state.weak = False
        state.index.extend(tokens)
        state.index.lookup.extend(tokens)

    def propose(self, state: SpecState, tokens: list[int], room: int) -> list[int]:
        """Up to the request's limit of proposals (at most `room`) after `tokens`, unless
        it rests (SpecState); weak (SpecState.weak) where they continue a match shorter
        than prompt_lookup_min and are not the copy gone on past an edit."""
        count = state.proposals(room)
        self.index(state, tokens)
        if count <= 0:
            return []
        config = self.config
        limits = (count, config.suffix_min_token_prob, config.suffix_max_spec_factor)
        index = state.index.own
        ends, length = index.match(tokens, index.depth // 2)
        own, own_score = index.continuation(ends, length, *limits)
        cached_ends, cached_length = self.cache.match(tokens, self.cache.depth // 2)
        cached, cached_score = self.cache.continuation(cached_ends, cached_length, *limits)
        lookup = state.index.lookup
        if own_score >= cached_score:  # (the own index's positions are the request's)
            fresh, end = own, index.source(ends, own)
        else:
            fresh, length, end = cached, cached_length, None
        proposal = lookup.arbitrate(tokens, fresh, count, end)
        state.weak = proposal is fresh and length < config.prompt_lookup_min
        return proposal

    def finished(self, output_token_ids: list[int]) -> None:
        """Adds a finished request's output to the server's index, evicting the oldest
        outputs past suffix_cache_max_tokens."""
        limit = self.config.suffix_cache_max_tokens
        if not output_token_ids or len(output_token_ids) > limit:
            return
        self.cache.add(output_token_ids)
        self.cached.append(len(output_token_ids))
        self.cached_tokens += len(output_token_ids)
        while self.cached_tokens > limit:
            oldest = self.cached.popleft()
            self.cache.drop_oldest(oldest + 1)  # (and its separator)
            self.cached_tokens -= oldest

    def forget(self) -> None:
        """Empties the server's index (LLMEngine.reset_prefix_cache)."""
        self.cache = SuffixIndex(self.config.suffix_max_depth)
        self.cached: collections.deque[int] = collections.deque()  # lengths, oldest first
        self.cached_tokens = 0

    def memory(self) -> dict[str, int]:
        """The server's index: outputs and tokens held, and its entries (n-gram
        occurrences)."""
        return {
            "cached_outputs": len(self.cached),
            "cached_tokens": self.cached_tokens,
            "entries": self.cache.num_entries,
        }
