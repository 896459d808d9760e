"""Warm-up progress (jaxinfer.engine.startup.warmup_progress): units done of how many, programs so
far, the time left at the pace so far; the last unit always logged."""

from __future__ import annotations

import logging

from jaxinfer.engine.startup.compilation_cache import CompileCounter
from jaxinfer.engine.startup.warmup_progress import WarmupProgress


def test_progress_lines_and_estimate(caplog):
    counter = CompileCounter()
    progress = WarmupProgress(4, counter, bar=True, log_every=0.0)
    assert progress.eta(0, 0.0) is None
    assert progress.eta(1, 3.0) == 9.0  # 3 s a unit, 3 units left
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.startup.warmup_progress"):
        for done in range(1, 5):
            counter.programs += 5
            progress(done, f"{2**done} tokens")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert lines[0].startswith("warm-up: 1/4 done (2 tokens), 5 programs") and "left" in lines[0]
    assert lines[-1].startswith("warm-up: 4/4 done (16 tokens), 20 programs")
    assert "left" not in lines[-1]


def test_lines_are_spaced_but_the_last_is_kept(caplog):
    progress = WarmupProgress(3, CompileCounter(), bar=False, log_every=3600.0)
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.startup.warmup_progress"):
        for done in range(1, 4):
            progress(done, "x")
    assert [r.getMessage()[:16] for r in caplog.records] == ["warm-up: 3/3 don"]
