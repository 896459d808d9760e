"""Which cases of a sweep the fast lane (`make check`) runs: a few chosen so that every value of
each parameter (strength 1), or every pair of values of two parameters (strength 2), occurs in
one of them; the rest are marked `slow` and run with the whole suite (`make test`)."""

from __future__ import annotations

import itertools

import pytest
from _pytest.mark import ParameterSet


def sweep(*axes, cases=None, strength: int = 1) -> list:
    """pytest params over the product of `axes` (each a list of values or pytest.params), or
    over `cases` (tuples of values), the ones past a greedy covering set marked slow. The first
    case covering the most uncovered values is taken each time, so the choice is stable."""
    if cases is None:
        cases = list(itertools.product(*axes))
    cases = [tuple(case) for case in cases]
    covered = _covering(cases, strength)
    params = []
    for i, case in enumerate(cases):
        values, marks, ids = [], [], []
        for value in case:
            if isinstance(value, ParameterSet):
                marks += value.marks
                ids.append(value.id)
                value = value.values[0]
            else:
                ids.append(None)
            values.append(value)
        if i not in covered:
            marks.append(pytest.mark.slow)
        case_id = "-".join(ids) if all(ids) else None
        params.append(pytest.param(*values, marks=marks, id=case_id))
    return params


def _key(value) -> str:
    return repr(value.values[0] if isinstance(value, ParameterSet) else value)


def _targets(case: tuple, strength: int) -> set:
    positions = itertools.combinations(range(len(case)), min(strength, len(case)))
    return {(p, tuple(_key(case[i]) for i in p)) for p in positions}


def _covering(cases: list[tuple], strength: int) -> set[int]:
    """Indices of a greedy set of cases whose combinations cover every case's."""
    targets = [_targets(case, strength) for case in cases]
    left = set().union(*targets)
    chosen = set()
    while left:
        best = max(range(len(cases)), key=lambda i: (len(targets[i] & left), -i))
        chosen.add(best)
        left -= targets[best]
    return chosen
