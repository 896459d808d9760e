"""One request's speculative decoding state: how many proposals it makes, and how often they
are accepted."""

from __future__ import annotations

import dataclasses
from typing import Any

MAX_COOLDOWN = 64  # most steps a request waits before proposing again after backing off
RESET_ACCEPTED = 4  # proposals accepted in one step that reset the cooldown
ACCEPTANCE_DECAY = 0.8  # weight of the earlier steps in a request's acceptance, per step
COPYING_ACCEPTED = 4  # a lookup probe's proposals accepted that make a request copying
# A request's acceptance at a proposal depth starts from this many steps' worth of the
# engine's there (SpecState.gains): a depth it seldom reached is planned at about the engine's.
DEPTH_PRIOR = 2.0
# And the engine's there starts from this many steps' worth of the request's acceptance.
ENGINE_DEPTH_PRIOR = 1.0
# Per step a plan takes none of a request's proposals, its evidence moves back this much
# toward a new request's (SpecState.declined).
DECLINED_RELAX = 0.95


@dataclasses.dataclass
class DepthEvidence:
    """Per proposal depth: steps whose proposals reached it (every one before it accepted),
    and of those the ones that accepted it, decayed by `decay` per step (a depth not reached
    for long comes back to its prior: a plan that stops before it never measures it again).
    A copy's deep proposals are accepted more often than its first (once a copy has gone on
    for some tokens it is likely to go on), which one acceptance for every depth misses."""

    decay: float
    reached: list[float] = dataclasses.field(default_factory=list)
    accepted: list[float] = dataclasses.field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        reached = min(num_accepted + 1, num_proposed)
        while len(self.reached) < reached:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for depth in range(len(self.reached)):
            self.reached[depth] = self.decay * self.reached[depth] + (depth < reached)
            self.accepted[depth] = self.decay * self.accepted[depth] + (depth < num_accepted)

    def relax(self, factor: float) -> None:
        """Keeps `factor` of the evidence: the rest goes back to the prior."""
        self.reached = [factor * n for n in self.reached]
        self.accepted = [factor * n for n in self.accepted]

    def acceptance(self, depth: int, prior: float, weight: float) -> float:
        """The chance a proposal at `depth` is accepted, given the ones before it were: the
        evidence with `weight` steps' worth of `prior` added."""
        if depth >= len(self.reached):
            return prior
        return (self.accepted[depth] + weight * prior) / (self.reached[depth] + weight)


@dataclasses.dataclass
class SpecState:
    """One request's trust in its proposals, as a length. Every proposal accepted: it grows by
    two; at least half accepted: one past the accepted ones; fewer: it halves. At 0 the
    request rests, proposing nothing, for a cooldown (doubling each time, up to MAX_COOLDOWN
    steps, until a step accepts RESET_ACCEPTED or more), then tries again. While it does not
    rest it proposes up to its limit, and each step takes as many as pay for their time
    (jaxinfer.engine.speculation.control, from `acceptance`). So a request whose proposals
    are mostly wrong soon stops making them (no host work, no rows in the sampler)."""

    limit: int  # the most proposals per step (the request's or the engine's)
    length: int = 0
    cooldown: int = 0  # steps left before the next try
    backoff: int = 4  # the next cooldown
    index: Any = None  # the proposer's per-request lookup (NgramIndex, RequestSuffix)
    # Recent proposals accepted and steps that rejected one, decayed per step: a geometric
    # model's evidence (each proposal is tried only if those before it were accepted).
    accepted: float = 1.0
    rejections: float = 1.0
    # Per proposal depth, the request's own (see DepthEvidence).
    depths: DepthEvidence = dataclasses.field(
        default_factory=lambda: DepthEvidence(ACCEPTANCE_DECAY)
    )
    # Whether the proposals made now are weak: a continuation of a match shorter than
    # prompt_lookup_min (suffix decoding's; set by the proposer, cleared when they are
    # recorded). Weak proposals keep an evidence of their own and never change the length:
    # a rejected guess from a one-token match says little about a forty-token copy, so it
    # must neither lower the acceptance the copy is planned with nor make the request rest.
    weak: bool = False
    weak_accepted: float = 1.0
    weak_rejections: float = 1.0
    # A draft model's: the leading tokens whose K/V its cache holds (DraftModel); steps in a
    # row it could have proposed in and did not; whether it follows the request no more
    # (jaxinfer.engine.speculation.propose: then it proposes nothing for the rest of it).
    draft_computed: int = 0
    draft_declined: int = 0
    draft_off: bool = False
    # A draft model's request that copies (draft_prompt_lookup; `index` an NgramIndex): a
    # probe step proposes a long match's continuation in place of the draft's proposals; if
    # COPYING_ACCEPTED of them are accepted, the request proposes by lookup alone from then
    # on (copying) and the draft leaves it; else probes wait a cooldown, doubling each time.
    lookup_probe: bool = False
    copying: bool = False
    probe_cooldown: int = 0
    probe_backoff: int = 4

    def __post_init__(self):
        self.length = self.limit

    def wanted(self) -> int:
        """Proposals to ask for now (0 while resting; a resting step counts down)."""
        if self.length == 0 and self.limit > 0:
            self.cooldown -= 1
            if self.cooldown <= 0:
                self.length = 1
        return self.length

    def proposals(self, room: int) -> int:
        """Proposals a host proposer makes now: up to the limit, at most `room` (what
        max_tokens and max_model_len leave), none while resting."""
        return max(min(self.limit if self.wanted() else 0, room), 0)

    @property
    def acceptance(self) -> float:
        """The chance that the next proposal is accepted, given the ones before it were (by
        the evidence of the weak proposals where the proposals made now are weak)."""
        if self.weak:
            return self.weak_accepted / (self.weak_accepted + self.weak_rejections)
        return self.accepted / (self.accepted + self.rejections)

    def gains(self, count: int, engine: DepthEvidence | None = None) -> tuple[float, ...]:
        """The expected tokens from each of `count` proposals: the chance that it and every
        one before it are accepted, the product of each depth's acceptance given the ones
        before it: the request's own evidence, from DEPTH_PRIOR steps at the engine's
        (`engine`: every request's evidence, from ENGINE_DEPTH_PRIOR steps at `acceptance`;
        without it, `acceptance`). Nonincreasing. Weak proposals: `acceptance` at every
        depth."""
        p = self.acceptance
        chance, gains = 1.0, []
        for depth in range(count):
            if not self.weak:
                prior = p if engine is None else engine.acceptance(depth, p, ENGINE_DEPTH_PRIOR)
                chance *= self.depths.acceptance(depth, prior, DEPTH_PRIOR)
            else:
                chance *= p
            gains.append(chance)
        return tuple(gains)

    def declined(self) -> None:
        """A step's plan took none of the request's proposals (their expected gain did not
        pay for their time): its evidence moves back toward a new request's (one accepted,
        one rejected), so that a request whose early proposals were rejected, and that so
        never proposes again, comes to try one again and learns its acceptance anew (its
        text may have come to a part that copies)."""
        self.accepted = 1.0 + DECLINED_RELAX * (self.accepted - 1.0)
        self.rejections = 1.0 + DECLINED_RELAX * (self.rejections - 1.0)
        self.weak_accepted = 1.0 + DECLINED_RELAX * (self.weak_accepted - 1.0)
        self.weak_rejections = 1.0 + DECLINED_RELAX * (self.weak_rejections - 1.0)
        self.depths.relax(DECLINED_RELAX)

    def record_failed_probe(self) -> None:
        self.probe_cooldown = self.probe_backoff
        self.probe_backoff = min(2 * self.probe_backoff, MAX_COOLDOWN)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        rejected = num_accepted < num_proposed
        if self.weak:
            self.weak = False
            self.weak_accepted = ACCEPTANCE_DECAY * self.weak_accepted + num_accepted
            self.weak_rejections = ACCEPTANCE_DECAY * self.weak_rejections + rejected
            return
        if self.lookup_probe:
            self.lookup_probe = False
            if num_accepted >= COPYING_ACCEPTED:
                self.copying = self.draft_off = True
            else:
                self.record_failed_probe()
        self.accepted = ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.rejections = ACCEPTANCE_DECAY * self.rejections + rejected
        self.depths.record(num_proposed, num_accepted)
        if num_accepted >= RESET_ACCEPTED:
            self.backoff = 4
        if num_accepted == num_proposed:
            self.length = min(self.limit, self.length + 2)
        elif 2 * num_accepted >= num_proposed:
            self.length = num_accepted + 1
        else:
            self.length //= 2
            if self.length == 0:
                self.cooldown = self.backoff
                self.backoff = min(2 * self.backoff, MAX_COOLDOWN)
