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

REALIGN_SPAN = 8  # tokens of a copy searched for the token an edit chose (NgramIndex.realign)
REALIGN_AFTER = 4  # tokens a copy must have had accepted before realign goes on with it
VERDICT_DECAY = 0.8  # weight of the earlier verdicts in NgramIndex.trust_copy, per verdict


class NgramIndex:
    """Where each n-gram of a token sequence (n in [min_n, max_n]) last occurred, extended as
    tokens arrive: a lookup costs max_n - min_n + 1 dict probes and each new token as many
    inserts, so proposing does not grow with the sequence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its last
        self.num_indexed = 0  # n-grams ending before this index are in the table
        # The last proposal's copy: where in the tokens it began, and how many tokens there
        # were then (realign).
        self.copied_from: int | None = None
        self.proposed_at = 0
        self.copy_run = 0  # its tokens accepted, in a row but for edits realign went past
        # Where the copy gone on with (realign) and a fresh match's continuation differed:
        # both proposals and where they were made, judged by the tokens that came next; and
        # the verdicts so far (decayed; above 0: the copy did better, so it is proposed).
        self.rivals: tuple[int, list[int], list[int]] | None = None
        self.trust_copy = 0.0

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
        back, is proposed for `count` tokens, not p). Where no suffix matches, or where the
        last proposal's copy goes on past an edit (realign) and has done better than fresh
        matches at this request's edits (arbitrate), the copy is proposed."""
        if count <= 0:
            return []
        end = self.match(tokens, min_n)
        return self.arbitrate(tokens, self.follow(tokens, end, count), count, end)

    def arbitrate(
        self, tokens: list[int], fresh: list[int], count: int, end: int | None = None
    ) -> list[int]:
        """`fresh` (a match's continuation, that after `end` if given; else another
        proposer's, kept as the copy where it is what followed the latest occurrence of the
        longest suffix found), or the last proposal's copy gone on past an edit (realign):
        the copy where `fresh` is empty, or where the two differ and the copy has done better
        than the fresh proposals where they differed before (trust_copy), judged by the
        tokens that came after them."""
        self._judge(tokens)
        copy_end = self.realign(tokens)
        copy = self.follow(tokens, copy_end, count)
        if copy and fresh and copy != fresh:
            self.rivals = (len(tokens), fresh, copy)
        if not fresh or (copy and copy != fresh and self.trust_copy > 0):
            self._keep(tokens, copy_end, realigned=True)
            return copy
        if end is None and fresh:
            end = self.match(tokens)
            if self.follow(tokens, end, len(fresh)) != fresh:
                end = None
        self._keep(tokens, end, realigned=False)
        return fresh

    def _judge(self, tokens: list[int]) -> None:
        """The verdict on the last rivals: the one whose leading tokens the tokens since
        followed further wins (no verdict on a tie)."""
        if self.rivals is None:
            return
        at, fresh, copy = self.rivals
        self.rivals = None
        lead_fresh, lead_copy = leading(fresh, tokens[at:]), leading(copy, tokens[at:])
        if lead_fresh != lead_copy:
            self.trust_copy = VERDICT_DECAY * self.trust_copy + (
                1.0 if lead_copy > lead_fresh else -1.0
            )

    def _keep(self, tokens: list[int], end: int | None, realigned: bool) -> None:
        """The proposal after the match that ends at `end` kept as the copy realign goes on
        with; copy_run grows where it goes on with the last one's (past an edit, or where
        every token since followed it), else starts again."""
        start, since = self.copied_from, len(tokens) - self.proposed_at
        if end is not None and realigned:
            self.copy_run += since - 1
        elif end is not None and start is not None and end + 1 == start + since:
            self.copy_run += since
        else:
            self.copy_run = 0
        self.copied_from = None if end is None else end + 1
        self.proposed_at = len(tokens)

    def realign(self, tokens: list[int]) -> int | None:
        """Where a copy the last proposal made likely goes on after an edit. The tokens
        since then followed the copy but the last, which the model chose in place of the
        copy's next token: if that token is in the copy's next REALIGN_SPAN tokens, the copy
        resumes after it (the model left some out), else after the token it replaced. The
        end of that match (as `match`), or None: no copy, one that has had fewer than
        REALIGN_AFTER tokens accepted (a chance match, as chat's often are), or the tokens
        since then left it before their last."""
        start, since = self.copied_from, len(tokens) - self.proposed_at
        if start is None or since < 1 or self.copy_run + since - 1 < REALIGN_AFTER:
            return None
        replaced = start + since - 1  # the copy's token the last one stands in place of
        if replaced >= self.proposed_at or tokens[start:replaced] != tokens[self.proposed_at : -1]:
            return None
        window = tokens[replaced : min(replaced + REALIGN_SPAN, self.proposed_at)]
        if tokens[-1] in window:
            return replaced + window.index(tokens[-1])
        return replaced

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


def leading(proposal: list[int], came: list[int]) -> int:
    """How many of `proposal`'s leading tokens `came` (the tokens after it) followed."""
    count = 0
    for proposed, token in zip(proposal, came, strict=False):
        if proposed != token:
            break
        count += 1
    return count


class NgramProposer:
    """Prompt lookup: proposes from each request's own tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def new_state(self, limit: int) -> SpecState:
        index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return SpecState(limit=limit, index=index)

    def index(self, state: SpecState, tokens: list[int]) -> None:
        """Indexes the request's tokens not indexed yet."""
        state.index.extend(tokens)

    def propose(self, state: SpecState, tokens: list[int], room: int) -> list[int]:
        """Up to the request's limit of proposals (at most `room`: what max_tokens and
        max_model_len leave) after `tokens`, unless it rests; the scheduler takes as many as
        pay for their time (jaxinfer.engine.speculation.control)."""
        return state.index.propose(tokens, state.proposals(room))
