"""The fast lane's share of a sweep (tests/support/lanes.py): every value, or every pair of
values, occurs in the cases it keeps; only the others are marked slow; a case's own marks stay."""

from __future__ import annotations

import itertools

import pytest

from tests.support.lanes import sweep


def _fast(params) -> list[tuple]:
    return [p.values for p in params if not any(m.name == "slow" for m in p.marks)]


def test_every_value_is_in_the_fast_lane():
    axes = [[16, 32, 64], [1, 3, 4, 8], ["a", "b"]]
    params = sweep(*axes)
    assert [p.values for p in params] == list(itertools.product(*axes))
    fast = _fast(params)
    assert len(fast) == 4  # as few as the longest axis allows
    for i, axis in enumerate(axes):
        assert {case[i] for case in fast} == set(axis)


def test_every_pair_at_strength_two():
    axes = [["Q4_K", "Q6_K", "Q8_0"], ["exact", "int8"], [1, 3, 8, 277]]
    fast = _fast(sweep(*axes, strength=2))
    for i, j in itertools.combinations(range(3), 2):
        assert {(c[i], c[j]) for c in fast} == set(itertools.product(axes[i], axes[j]))
    assert len(fast) < 24


def test_given_cases_and_the_marks_they_carry():
    skip = pytest.mark.skipif(True, reason="no such CPU")
    cases = [(1, "x"), (2, "x"), (1, pytest.param("y", marks=skip, id="y"))]
    params = sweep(cases=cases)
    assert [p.values for p in params] == [(1, "x"), (2, "x"), (1, "y")]
    assert _fast(params) == [(1, "x"), (2, "x"), (1, "y")]  # each adds a value
    assert params[2].marks == [skip]
    assert sweep(cases=[(1, "x"), (1, "x")])[1].marks[0].name == "slow"
