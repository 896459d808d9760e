"""Speculative decoding's n-gram proposals (prompt lookup).

A request's proposals are scheduled as more tokens of its next step (jaxinfer.engine.scheduling.scheduler):
the step samples at the request's last token and at each proposal, every position exactly as a
step without proposals would (same logits processors, same random key for the same output
position), and the leading proposals equal to the tokens sampled before them are accepted.
With one-hot proposals (n-gram) that is rejection sampling: proposal d is accepted with
probability p(d) = min(1, p(d) / q(d)), and a rejected position's sample is a draw from p
without d, which is the normalized max(p - q, 0). So the output distribution, and with a seed
the tokens themselves, are those of decoding without speculation.
"""

from __future__ import annotations

from jaxinfer.config import SpeculativeConfig
from jaxinfer.engine.speculation.state import SpecState


class NgramIndex:
    """Where each n-gram of a token sequence (n in [min_n, max_n]) last occurred, extended as
    tokens arrive: a lookup costs max_n - min_n + 1 dict probes and each new token as many
    inserts, so proposing does not grow with the sequence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its last
        self.num_indexed = 0  # n-grams ending before this index are in the table

    def extend(self, tokens: list[int]) -> None:
        """Indexes the n-grams that end before the last token (each has a successor)."""
        for end in range(self.num_indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], count: int, min_n: int | None = None) -> list[int]:
        """The `count` tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` found (of at least `min_n` tokens, default the index's), copied as LZ77
        copies a match that overlaps its own output: where the copy reaches the end of
        `tokens` it goes on over the tokens it proposed (a loop of period p, found p tokens
        back, is proposed for `count` tokens, not p)."""
        if count <= 0:
            return []
        return self.follow(tokens, self.match(tokens, min_n), count)

    @staticmethod
    def follow(tokens: list[int], end: int | None, count: int) -> list[int]:
        """The `count` tokens after the occurrence that ends at `end` (a match), copied on
        over the copy where it reaches the end of `tokens`; none without a match."""
        if end is None or count <= 0:
            return []
        proposed = tokens[end + 1 : end + 1 + count]
        while len(proposed) < count:
            proposed.append(proposed[len(proposed) - (len(tokens) - end - 1)])
        return proposed

    def match(self, tokens: list[int], min_n: int | None = None) -> int | None:
        """Where the latest earlier occurrence of the longest suffix of `tokens` found (of at
        least `min_n` tokens, default the index's) ends, or None."""
        self.extend(tokens)
        shortest = self.min_n if min_n is None else max(min_n, self.min_n)
        for n in range(min(self.max_n, len(tokens) - 1), shortest - 1, -1):
            end = self.last_end.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return end
        return None


class NgramProposer:
    """Prompt lookup: proposes from each request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def new_state(self, limit: int) -> SpecState:
        index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return SpecState(limit=limit, index=index)

    def propose(self, state: SpecState, tokens: list[int], room: int) -> list[int]:
        """Up to the request's limit of proposals (at most `room`: what max_tokens and
        max_model_len leave) after `tokens`, unless it rests; the scheduler takes as many as
        pay for their time (jaxinfer.engine.speculation.control)."""
        return state.index.propose(tokens, state.proposals(room))
