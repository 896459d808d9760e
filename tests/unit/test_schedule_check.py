"""The schedule digest (jaxinfer.engine.schedule_check): equal schedules agree, and every
field that changes what a step runs changes it."""

from __future__ import annotations

import pytest

from jaxinfer.engine.execution.step import ScheduledRequest, SchedulerOutput
from jaxinfer.engine.schedule_check import check_same_schedule, schedule_digest
from jaxinfer.sampling_params import SamplingParams


def scheduled(**changes) -> ScheduledRequest:
    fields = dict(
        request_id="a",
        num_computed_tokens=4,
        num_new_tokens=2,
        token_ids=(7, 8),
        block_ids=(1, 2),
        samples=True,
        output_position=0,
        epoch=0,
        params=SamplingParams(),
        seed=11,
        has_bias=False,
        prompt_token_ids=(1, 2, 3, 4, 7, 8),
        draft_token_ids=(),
    )
    return ScheduledRequest(**{**fields, **changes})


def output(*items, **changes) -> SchedulerOutput:
    return SchedulerOutput(
        items, sum(i.num_new_tokens for i in items), **{"released": ("z",), **changes}
    )


def test_equal_schedules_have_equal_digests():
    assert schedule_digest(output(scheduled())) == schedule_digest(output(scheduled()))
    check_same_schedule(output(scheduled()), step=1)  # one process: nothing to compare


@pytest.mark.parametrize(
    "change",
    [
        {"request_id": "b"},
        {"num_computed_tokens": 5},
        {"token_ids": (7, 9)},
        {"block_ids": (1, 3)},
        {"samples": False},
        {"output_position": 1},
        {"seed": 12},
        {"draft_token_ids": (4,)},
    ],
)
def test_each_field_that_changes_the_step_changes_the_digest(change):
    assert schedule_digest(output(scheduled(**change))) != schedule_digest(output(scheduled()))


def test_order_preemptions_and_releases_change_the_digest():
    a, b = scheduled(), scheduled(request_id="b")
    base = schedule_digest(output(a, b))
    assert schedule_digest(output(b, a)) != base
    assert schedule_digest(output(a, b, preempted=("c",))) != base
    assert schedule_digest(output(a, b, released=())) != base
