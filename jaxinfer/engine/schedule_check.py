"""A debug check for jobs of several processes: every process must run the same schedule.

Before each step, every process gathers a digest of the step's schedule from all the others;
a difference stops every process at that step with an error naming it, instead of the hang in
a collective (or the silently different shards) a divergence would otherwise cause.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from jaxinfer.engine.execution.step import SchedulerOutput
from jaxinfer.parallel.distributed import gather_rows


class DistributedError(RuntimeError):
    """A process of the job failed, left, or diverged from process 0's schedule."""


def schedule_digest(output: SchedulerOutput) -> bytes:
    """32 bytes that differ when two schedules would run different steps."""
    items = tuple(
        (
            s.request_id,
            s.num_computed_tokens,
            s.num_new_tokens,
            tuple(s.token_ids),
            tuple(s.block_ids),
            s.samples,
            s.output_position,
            s.seed,
            tuple(s.draft_token_ids),
        )
        for s in output.scheduled
    )
    summary = (items, output.num_scheduled_tokens, output.preempted, output.released)
    return hashlib.sha256(repr(summary).encode()).digest()


def check_same_schedule(output: SchedulerOutput, step: int) -> None:
    """Raises DistributedError on every process when any process's schedule for `step`
    differs from process 0's (a collective: every process must call it at every step)."""
    if jax.process_count() == 1:
        return
    mine = np.frombuffer(schedule_digest(output), np.uint8).astype(np.int32)
    every = gather_rows(mine)  # [P, 32]
    differ = [p for p in range(1, every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise DistributedError(
            f"check_schedule: step {step}: the schedule of process(es) {differ} differs from "
            f"process 0's ({len(output.scheduled)} requests, {output.num_scheduled_tokens} "
            "tokens here); the processes were given different requests or calls"
        )
