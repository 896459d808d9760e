"""Speculation that knows when to stop: each step takes the proposals that pay for their time
at the rate the engine's steps give, from the step times it measures and each request's
acceptance.

The engine measures the time of every step it runs by its T scheduled tokens (StepCosts, a
moving average per T, linear between measured counts, kept apart by the number of requests
that sample: a prompt chunk costs another time than as many decodes). Not by T's token
bucket: where the device runs the bucket's padded shape, the counts in one bucket measure
alike, but the CPU's kernels skip the padding, and there a proposal in a bucket's padding
costs about what a decode does. Proposals grow the step to T + P tokens, and, with a draft
model, cost the draft's one-token steps too. The d-th proposal of a request gains the chance
that it and every one before it are accepted (SpecState.gains: per depth, given the ones
before it; a copy's deep proposals are likelier than its first), so the step's expected
tokens are its sampling requests plus the gains of its proposals. The plan takes the largest
gains first, and of the totals P whose rate is at least MARGIN times the rate without
proposals, the one that maximizes

    sampling requests + gains of the P proposals - price x (time of T + P tokens + draft steps)

with the price of a second the rate the steps that decode and verify give (a moving
average, SpecControl.rate; at least the rate without proposals). That is the long-run rate's
best (a step that maximized its own rate would stop a copy's proposals where a deeper one
still gains more than its time gives elsewhere: Dinkelbach's method, the rate its price).
P = 0 when nothing pays: a low acceptance (the gains are small) or a slow verify step (the
time grows with the tokens: a large batch, or any batch on a CPU bound by compute). A host
proposer (n-gram, suffix) is planned for before it looks up proposals, each candidate at its
limit, and pays its lookups' measured time per request (SpecControl.host): where that plan
takes nothing, nothing is looked up. A step whose own token count has no time (measured, or
between measured counts) takes no proposal (and so measures it); counts it could grow to
that have none are left out, but one plan in EXPLORE_EVERY takes proposals up to the end of
the next token bucket, which measures it. And after every EXPLORE_EVERY plans that took
nothing, the next such plan takes the likeliest proposal anyway (revisit): one more token's
time and that request's acceptance are measured again, where a step time measured high once
(a noisy step) or an acceptance from a bad start would keep proposals off for good (a step
that is never taken is never measured again). At most one step in EXPLORE_EVERY pays for a
proposal that does not. Until the draft model's step has been measured, the scheduler's rule
of thumb decides (proposals only where they cost nothing,
SchedulerConfig.spec_free_tokens).
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxinfer.config import SchedulerConfig
from jaxinfer.engine.speculation.state import DepthEvidence, SpecState

EMA_WEIGHT = 0.2  # weight of the newest step time in a key's average
# A plan takes proposals only where it expects this many times the tokens per second of none:
# the step times are noisy averages, and a smaller gain is as likely a loss.
MARGIN = 1.10
# A plan in this many tries token counts not measured yet (if any would do), and after as
# many plans in a row that took nothing, the next takes one proposal (revisit).
EXPLORE_EVERY = 32
# Weight of the earlier steps in the engine's acceptance per depth (DepthEvidence), per step.
ENGINE_DEPTH_DECAY = 0.98


class StepCosts:
    """Seconds per step, by key (scheduled tokens, or a draft's rows): a moving average of
    what the engine measured; between measured keys, linear in the key."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.keys: list[int] = []  # the measured keys, ascending

    def observe(self, key: int, seconds: float) -> None:
        old = self.seconds.get(key)
        if old is None:
            bisect.insort(self.keys, key)
        self.seconds[key] = seconds if old is None else old + EMA_WEIGHT * (seconds - old)

    def estimate(self, key: int) -> float | None:
        """The key's time: measured, or interpolated between the nearest measured keys on
        either side; None past the measured ones (not known)."""
        if key in self.seconds:
            return self.seconds[key]
        keys = self.keys
        index = bisect.bisect_left(keys, key)
        if index == 0 or index == len(keys):
            return None
        low, high = keys[index - 1], keys[index]
        share = (key - low) / (high - low)
        return self.seconds[low] + share * (self.seconds[high] - self.seconds[low])


@dataclasses.dataclass
class Throughput:
    """Tokens and seconds of steps, moving averages (the first step's own at first)."""

    tokens: float = 0.0
    seconds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        weight = EMA_WEIGHT if self.seconds else 1.0
        self.tokens += weight * (tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)

    @property
    def rate(self) -> float:
        """Tokens per second; 0 before a step is observed."""
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A request that may verify proposals in the next step."""

    # The expected tokens from each proposal it could verify (its proposals, its limit, the
    # room): the chance that it and every one before it are accepted (SpecState.gains).
    gains: tuple[float, ...]

    @property
    def most(self) -> int:
        return len(self.gains)


@dataclasses.dataclass
class SpecControl:
    """Plans each step's proposals from measured times (see the module docstring)."""

    buckets: tuple[int, ...]  # the token buckets, ascending (what exploring measures)
    # Step times by sampling requests (a power of two: their sample rows and attention cost
    # too), then by scheduled tokens.
    target: dict[int, StepCosts] = dataclasses.field(default_factory=dict)
    # The steps that only decode and verify, by sampling requests (as `target`): the rate a
    # plan's time is priced at.
    rates: dict[int, Throughput] = dataclasses.field(default_factory=dict)
    # Every request's proposals' acceptance per depth (SpecState.gains' prior); weak ones not.
    depths: DepthEvidence = dataclasses.field(
        default_factory=lambda: DepthEvidence(ENGINE_DEPTH_DECAY)
    )
    draft: StepCosts = dataclasses.field(default_factory=StepCosts)  # a draft step, by rows
    host: StepCosts = dataclasses.field(default_factory=StepCosts)  # host lookups, per request
    planned: int = 0  # steps planned by measured times (not by the rule of thumb)
    declined: int = 0  # of which chose no proposal where the rule of thumb would have some
    explored: int = 0  # of which took proposals into a bucket not measured yet
    revisited: int = 0  # of which took one proposal after EXPLORE_EVERY declined (revisit)
    idle: int = 0  # plans with candidates that took none since one took some

    @staticmethod
    def key(num_sampling: int) -> int:
        return 1 << max(num_sampling - 1, 0).bit_length()

    def costs(self, num_sampling: int) -> StepCosts:
        return self.target.setdefault(self.key(num_sampling), StepCosts())

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[
            min(bisect.bisect_left(self.buckets, num_tokens), len(self.buckets) - 1)
        ]

    def observe_step(self, num_tokens: int, num_sampling: int, seconds: float) -> None:
        """A step of `num_tokens` scheduled tokens, `num_sampling` requests sampling, took
        `seconds` (host and device, without proposing the next step's tokens)."""
        self.costs(num_sampling).observe(num_tokens, seconds)

    def observe_tokens(self, num_sampling: int, tokens: int, seconds: float) -> None:
        """A step that only decoded and verified proposals, `num_sampling` requests sampling,
        gave `tokens` tokens in `seconds` (its proposing included)."""
        self.rates.setdefault(self.key(num_sampling), Throughput()).observe(tokens, seconds)

    def rate(self, num_sampling: int) -> float:
        """Tokens per second that steps with `num_sampling` requests sampling gave (moving
        averages of their tokens and seconds); 0 before one is measured."""
        return self.rates.get(self.key(num_sampling), Throughput()).rate

    def observe_draft(self, num_rows: int, num_steps: int, seconds: float) -> None:
        """The draft proposed for `num_rows` requests in `num_steps` one-token steps."""
        if num_steps > 0:
            self.draft.observe(num_rows, seconds / num_steps)

    def observe_host(self, num_requests: int, seconds: float) -> None:
        """A host proposer looked up proposals for `num_requests` requests in `seconds`."""
        if num_requests > 0:
            self.host.observe(1, seconds / num_requests)

    def plan(
        self,
        used: int,
        num_sampling: int,
        candidates: list[Candidate],
        free_room: int,
        most: int,
        draft_rows: int = 0,
        host_rows: int = 0,
        draft_free: int = 0,
    ) -> list[int]:
        """Proposals per candidate for a step of `used` tokens of which `num_sampling`
        requests sample. `free_room`: what the rule of thumb would take (used where times
        are not known yet); `most`: the most proposals the step may take in all (the budget,
        the sample rows). `draft_rows`: with a draft model, the rows it proposes for (its
        steps are paid per proposal depth, for every row at once). `host_rows`: with a host
        proposer that has not proposed yet, the requests it would propose for (paid once
        the plan takes any proposal). `draft_free`: proposal depths that cost no step of
        the draft's (the MTP layer's first, from its run over the step, which runs anyway)."""
        gains = sorted(
            ((gain, index) for index, c in enumerate(candidates) for gain in c.gains),
            reverse=True,
        )
        total = min(len(gains), most)
        table = self.costs(num_sampling)
        base = table.estimate(used)
        if base is None:  # this step measures it
            return [0] * len(candidates)
        draft_step = self.draft.estimate(draft_rows) if draft_rows else 0.0
        if draft_step is None:  # (the rule of thumb runs the draft, which measures it)
            return self._take(candidates, gains[: min(total, free_room)])
        costs = [table.estimate(used + p) for p in range(total + 1)]
        self.planned += 1
        unknown = [p for p in range(1, total + 1) if costs[p] is None]
        if unknown and self.planned % EXPLORE_EVERY == 0:  # measure the next bucket up
            self.explored += 1
            self.idle = 0
            bucket = self.bucket(used + unknown[0])
            last = max(p for p in unknown if self.bucket(used + p) == bucket)
            return self._take(candidates, gains[:last])
        proposing = (self.host.estimate(1) or 0.0) * host_rows
        # (time is priced at the rate the steps give, at least the rate of none)
        price = max(self.rate(num_sampling), num_sampling / base)
        least = MARGIN * num_sampling / base
        best, best_value = 0, num_sampling - price * base
        expected, depths = float(num_sampling), {}
        for p in range(1, total + 1):
            gain, index = gains[p - 1]
            expected += gain
            depths[index] = depths.get(index, 0) + 1
            if costs[p] is None:
                continue
            steps = max(max(depths.values()) - draft_free, 0)
            seconds = costs[p] + draft_step * steps + proposing
            value = expected - price * seconds
            if expected / seconds > least and value > best_value:
                best, best_value = p, value
        if best == 0 and min(total, free_room) > 0:
            self.declined += 1
        final = not (draft_rows or host_rows)  # (else the scheduler plans again after it)
        if best == 0 and total and self.idle >= EXPLORE_EVERY:  # the likeliest, again
            best = 1
            self.revisited += final
        self.idle = 0 if best and final else self.idle + (best == 0 and total > 0)
        return self._take(candidates, gains[:best])

    @staticmethod
    def _take(candidates: list[Candidate], gains: list[tuple[float, int]]) -> list[int]:
        counts = [0] * len(candidates)
        for _, index in gains:
            counts[index] += 1
        return counts


def free_room(config: SchedulerConfig, used: int) -> int:
    """The rule of thumb: proposal tokens a step of `used` scheduled tokens has room for at
    no cost, its token bucket's padding or up to spec_free_tokens tokens, within the budget,
    and at most spec_free_tokens proposals (the sample rows' bucket)."""
    buckets = config.token_buckets
    room = max(buckets[bisect.bisect_left(buckets, used)], config.spec_free_tokens) - used
    return min(room, config.max_num_batched_tokens - used, config.spec_free_tokens)


def plan_proposals(
    config: SchedulerConfig,
    control: SpecControl | None,
    used: int,
    num_sampling: int,
    wanted: list[tuple[SpecState | None, int]],
    draft_rows: int = 0,
    host_rows: int = 0,
    draft_free: int = 0,
) -> list[int]:
    """Proposals to take of each (request's SpecState, most it could verify) in a step of
    `used` tokens of which `num_sampling` requests sample: SpecControl's plan where there is
    one (over SpecState.gains), else the rule of thumb in order (free_room)."""
    room = free_room(config, used)
    most = min(config.max_num_batched_tokens - used, config.spec_free_tokens)
    if control is not None:
        candidates = [
            Candidate(spec.gains(min(count, most), control.depths) if spec else ())
            for spec, count in wanted
        ]
        return control.plan(
            used, num_sampling, candidates, room, most, draft_rows, host_rows, draft_free
        )
    counts = []
    for _, count in wanted:
        counts.append(min(count, max(room, 0)))
        room -= counts[-1]
    return counts


def record_verdict(
    control: SpecControl | None, spec: SpecState, num_proposed: int, num_accepted: int
) -> None:
    """A request's proposals were verified: its evidence, and the engine's (weak ones
    aside: they keep their own, SpecState.weak)."""
    if control is not None and not spec.weak:
        control.depths.record(num_proposed, num_accepted)
    spec.record(num_proposed, num_accepted)
