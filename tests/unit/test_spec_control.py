"""SpecControl: each step's proposals planned from measured step times and acceptance."""

from __future__ import annotations

import itertools

import pytest

from jaxinfer.engine.speculation.control import (
    EXPLORE_EVERY,
    MARGIN,
    Candidate,
    SpecControl,
    StepCosts,
)
from jaxinfer.engine.speculation.state import DepthEvidence, SpecState

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def geometric(acceptance: float, most: int) -> Candidate:
    """A request that accepts each next proposal with the same chance."""
    return Candidate(tuple(acceptance ** (depth + 1) for depth in range(most)))


def control_with(costs: dict[int, float], num_sampling: int = 1) -> SpecControl:
    """Step times of steps in which `num_sampling` requests sample."""
    control = SpecControl(BUCKETS)
    for bucket, seconds in costs.items():
        control.observe_step(bucket, num_sampling, seconds)
    return control


def value_of(control, used, num_sampling, candidates, counts, draft_rows=0, draft_free=0):
    """(rate, value) of giving each candidate `counts` proposals: tokens per second, and the
    expected tokens less the time at the plan's price."""
    gain = sum(sum(c.gains[:k]) for c, k in zip(candidates, counts, strict=True))
    seconds = control.costs(num_sampling).estimate(used + sum(counts))
    if draft_rows and max(counts):
        seconds += control.draft.estimate(draft_rows) * max(max(counts) - draft_free, 0)
    none = num_sampling / control.costs(num_sampling).estimate(used)
    price = max(control.rate(num_sampling), none)
    return (num_sampling + gain) / seconds, num_sampling + gain - price * seconds


def brute_force(control, used, num_sampling, candidates, most, draft_rows=0, draft_free=0):
    """The best value over every way of giving each candidate 0..most proposals whose rate
    gains MARGIN over none's (none's value where none does)."""
    none = num_sampling / control.costs(num_sampling).estimate(used)
    best = value_of(control, used, num_sampling, candidates, [0] * len(candidates))[1]
    for counts in itertools.product(*(range(c.most + 1) for c in candidates)):
        if sum(counts) > most or not sum(counts):
            continue
        rate, value = value_of(
            control, used, num_sampling, candidates, counts, draft_rows, draft_free
        )
        if rate > MARGIN * none:
            best = max(best, value)
    return best


def test_step_costs_average_and_interpolate():
    costs = StepCosts()
    costs.observe(2, 1.0)
    costs.observe(2, 2.0)
    assert costs.estimate(2) == pytest.approx(1.2)  # a moving average
    costs.observe(8, 3.0)
    assert costs.estimate(4) == pytest.approx(1.2 + (3.0 - 1.2) / 3)
    assert costs.estimate(1) is None and costs.estimate(16) is None  # not measured around


def test_free_verification_takes_every_proposal():
    """Verify steps as cheap as one token's: every proposal pays."""
    control = control_with({b: 0.010 for b in BUCKETS})
    candidates = [geometric(0.5, 5)]
    assert control.plan(1, 1, candidates, free_room=0, most=7) == [5]


def test_a_plan_gains_its_margin_or_takes_none():
    """Free verification: 9 % more tokens a second is within the times' noise and their
    bias, 11 % is not."""
    assert MARGIN == 1.10
    control = control_with({1: 0.010, 2: 0.010})
    assert control.plan(1, 1, [geometric(0.09, 1)], free_room=1, most=1) == [0]
    assert control.plan(1, 1, [geometric(0.11, 1)], free_room=1, most=1) == [1]


def test_costly_verification_or_low_acceptance_takes_none():
    """A step's time grows with its tokens (a CPU bound by compute): low acceptance never
    pays, high acceptance pays for a few."""
    control = control_with({b: 0.040 * b for b in BUCKETS})  # linear: nothing is free
    assert control.plan(1, 1, [geometric(0.3, 5)], free_room=7, most=7) == [0]
    assert control.declined == 1
    control = control_with({1: 0.040, 2: 0.058, 4: 0.076, 8: 0.125, 16: 0.27})
    counts = control.plan(1, 1, [geometric(0.9, 7)], free_room=7, most=7)
    assert 0 < counts[0] <= 7


def test_a_full_bucket_takes_proposals_only_where_they_pay():
    """32 decodes fill bucket 32; the next bucket costs 1.5x: only acceptance that gains more
    than half a step's tokens is worth it."""
    control = control_with({32: 1.0, 64: 1.5}, num_sampling=32)
    low = [geometric(0.2, 5) for _ in range(32)]
    assert sum(control.plan(32, 32, low, free_room=0, most=8)) == 0
    high = [geometric(0.95, 5) for _ in range(32)]
    assert sum(control.plan(32, 32, high, free_room=0, most=32)) == 32


def test_a_buckets_padding_is_free_only_where_the_times_say_so():
    """20 decodes in bucket 24: where the device runs the padded shape, 20 and 24 tokens
    measure alike and 4 proposals at 0.6 ride free; where its kernels skip the padding (the
    CPU's), each token costs its share and they do not pay."""
    candidates = [geometric(0.6, 5) for _ in range(20)]
    padded = control_with({20: 0.060, 24: 0.060, 32: 0.080}, num_sampling=20)
    assert sum(padded.plan(20, 20, candidates, free_room=4, most=8)) == 4
    per_token = control_with({20: 0.060, 24: 0.072, 32: 0.096}, num_sampling=20)
    assert sum(per_token.plan(20, 20, candidates, free_room=4, most=8)) == 0


def test_unmeasured_buckets_are_measured_first():
    candidates = [geometric(0.1, 5), geometric(0.9, 5)]
    # The step's own bucket never ran: no proposals, so that it is measured.
    assert SpecControl(BUCKETS).plan(2, 2, candidates, free_room=3, most=8) == [0, 0]
    # Bucket 4 and up never ran: left out, but for one plan in EXPLORE_EVERY.
    control = control_with({2: 0.01}, num_sampling=2)
    plans = [control.plan(2, 2, candidates, free_room=3, most=8) for _ in range(EXPLORE_EVERY)]
    assert all(counts == [0, 0] for counts in plans[:-1])
    assert plans[-1] == [0, 2] and control.explored == 1  # into bucket 4: the likelier first
    # Measured with other requests sampling (a prompt chunk): not this step's time.
    control.observe_step(8, 1, 0.001)
    assert control.plan(2, 2, candidates, free_room=3, most=8) == [0, 0]


@pytest.mark.parametrize("seed", range(20))
def test_plan_is_as_good_as_brute_force(seed):
    import random

    rng = random.Random(seed)
    times = {1: 0.01}
    for bucket in BUCKETS[1:]:
        times[bucket] = times[BUCKETS[BUCKETS.index(bucket) - 1]] * rng.uniform(1.0, 1.9)
    control = control_with(times, num_sampling=2)
    control.observe_draft(3, 1, rng.uniform(0.0, 0.01))
    candidates = [geometric(rng.uniform(0, 1), rng.randint(0, 4)) for _ in range(3)]
    used = rng.randint(1, 20)
    most = rng.randint(0, 8)
    if seed % 2:  # (the steps' rate, the price of their time, above none's)
        control.observe_tokens(2, 4, 0.011)
    # (draft_free 1: the MTP layer's first proposal costs no step of its own)
    for draft_rows, free in ((0, 0), (3, 0), (3, 1)):
        counts = control.plan(
            used, 2, candidates, free_room=0, most=most, draft_rows=draft_rows, draft_free=free
        )
        assert sum(counts) <= most
        assert all(k <= c.most for k, c in zip(counts, candidates, strict=True))
        best = brute_force(control, used, 2, candidates, most, draft_rows, free)
        got = value_of(control, used, 2, candidates, counts, draft_rows, free)[1]
        # The plan takes the largest gains first: optimal without a draft; with one, its
        # steps are paid by depth, which can favour spreading over requests.
        assert got == pytest.approx(best) if not draft_rows else got >= best - 0.5


def test_acceptance_follows_recent_steps():
    state = SpecState(limit=5)
    assert state.acceptance == pytest.approx(0.5)  # the prior
    for _ in range(10):
        state.record(5, 5)
    assert state.acceptance > 0.95
    for _ in range(20):
        state.record(5, 0)
    assert state.acceptance < 0.1


def test_a_host_proposers_time_is_paid_by_the_plan_before_it_proposes():
    """32 decodes, the next bucket 1.5x: 32 proposals at 0.95 pay for 0.27 s more, so
    proposing for 32 requests at 5 ms each still pays, at 20 ms each not; once proposed
    (host_rows=0: its time is spent) the same plan takes them."""
    high = [geometric(0.95, 5) for _ in range(32)]
    for per_request, taken in ((None, 32), (0.005, 32), (0.02, 0)):
        control = control_with({32: 1.0, 64: 1.5}, num_sampling=32)
        if per_request is not None:
            control.observe_host(32, 32 * per_request)
        assert sum(control.plan(32, 32, high, free_room=0, most=32, host_rows=32)) == taken
        assert sum(control.plan(32, 32, high, free_room=0, most=32)) == 32


def test_a_request_whose_proposals_a_plan_declines_comes_to_try_one_again():
    """Step times where one proposal pays at a new request's acceptance (0.5) but not after a
    rejection: a request whose first proposal was rejected would never propose again (its
    acceptance moves only with proposals verified); each declined step moves its evidence
    back toward a new request's, so a plan takes one of its proposals again after some steps
    (not at once)."""
    control = control_with({1: 0.087, 2: 0.109, 4: 0.157, 8: 0.237, 16: 0.45})
    state = SpecState(limit=8)
    assert control.plan(1, 1, [Candidate(state.gains(8))], 7, 8)[0] > 0
    state.record(2, 0)  # both rejected
    state.record(1, 0)
    declined = 0
    while not control.plan(1, 1, [Candidate(state.gains(8))], 7, 8)[0]:
        state.declined()
        declined += 1
        assert declined < 64, state.acceptance
    assert declined > 1


def test_a_step_time_measured_high_once_is_measured_again():
    """A two-token step measured once at 18 ms (a noisy step) against 11 ms for one: at a new
    request's acceptance no proposal pays, and none would ever be taken again, so that time
    would stay. After EXPLORE_EVERY plans that took none, the next takes the likeliest
    proposal; a host proposer's plan before its lookups keeps that for the scheduler's plan
    after them. Its step measures the true time, and the plans go on taking proposals."""
    control = control_with({1: 0.011, 2: 0.018, 4: 0.030, 8: 0.05, 16: 0.1})
    candidates = [geometric(0.4, 8), geometric(0.6, 8)]
    plans = [control.plan(1, 1, candidates, 3, 8, host_rows=2) for _ in range(EXPLORE_EVERY)]
    assert all(counts == [0, 0] for counts in plans)
    assert control.plan(1, 1, candidates, 3, 8, host_rows=2) == [0, 1]  # (the lookups' plan)
    assert control.revisited == 0
    assert control.plan(1, 1, candidates, 3, 8) == [0, 1] and control.revisited == 1
    assert control.plan(1, 1, candidates, 3, 8) == [0, 0]  # once
    for _ in range(10):
        control.observe_step(2, 1, 0.012)
    assert control.plan(1, 1, candidates, 3, 8) == [0, 1]


def test_a_depth_not_reached_for_long_comes_back_to_its_prior():
    evidence = DepthEvidence(0.8)
    evidence.record(4, 1)  # the second rejected: depths 0 and 1 reached, 2 and 3 not
    assert evidence.acceptance(0, 0.5, 1.0) == pytest.approx((1 + 0.5) / (1 + 1))
    assert evidence.acceptance(1, 0.5, 1.0) == pytest.approx(0.5 / 2)
    assert evidence.acceptance(2, 0.7, 1.0) == pytest.approx(0.7)  # (no evidence there)
    for _ in range(40):
        evidence.record(1, 1)  # only the first proposal, always accepted
    assert evidence.acceptance(0, 0.5, 1.0) == pytest.approx((5 + 0.5) / (5 + 1), abs=0.01)
    assert evidence.acceptance(1, 0.5, 1.0) == pytest.approx(0.5, abs=0.01)  # forgotten


def test_gains_follow_each_depths_acceptance():
    """A copy: half the steps reject the first proposal, the others accept all eight. One
    acceptance for every depth (above 0.9) overrates the first proposal and underrates the
    eighth; per depth each gains the first's chance, about a half, and a new request plans
    at about the engine's."""
    engine = DepthEvidence(0.98)
    state = SpecState(limit=8)
    for _ in range(30):
        for accepted in (0, 8):
            engine.record(8, accepted)
            state.record(8, accepted)
    p = state.acceptance
    assert p > 0.9 and p**8 < 0.5
    gains = state.gains(8, engine)
    assert 0.5 < gains[0] < 0.6 and gains == pytest.approx([gains[0]] * 8, abs=0.02)
    new = SpecState(limit=8).gains(8, engine)  # (its own evidence: none)
    assert new[0] == pytest.approx(0.5, abs=0.02) and new[-1] > 0.4  # (0.5 ** 8 by one p)
    state.weak = True  # a weak proposal: its own evidence, the same at every depth
    assert state.gains(3, engine) == pytest.approx([0.5, 0.25, 0.125])


def test_time_is_priced_at_the_rate_the_steps_give():
    """A copy's proposals, each token 20 ms: the step's own best rate stops at six, but the
    seventh gains more tokens than its time gives at the rate of none, so a plan takes it;
    where the steps give a higher rate (40 tokens a second, measured by observe_tokens) the
    time is dearer and a plan stops early."""
    copy = Candidate((0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.55))
    times = {1: 0.080, 2: 0.1, 4: 0.14, 8: 0.22, 16: 0.38}
    control = control_with(times)
    rates = [(1 + sum(copy.gains[:p])) / control.costs(1).estimate(1 + p) for p in range(8)]
    assert max(range(8), key=rates.__getitem__) == 6
    assert control.plan(1, 1, [copy], 7, 8) == [7]
    control.observe_tokens(1, 40, 1.0)
    assert control.rate(1) == pytest.approx(40.0)
    assert control.plan(1, 1, [copy], 7, 8) == [2]
    control.observe_tokens(1, 1, 1.0)  # (a moving average: the newest step weighs 0.2)
    assert control.rate(1) == pytest.approx((40 - 0.2 * 39) / 1.0)
