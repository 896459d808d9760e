"""Warm-up progress: which of the warm-up's units (token buckets, then the row updates and the
draft model) are compiled, how many programs that took, and an estimate of the time left, in
the log (at most every few seconds) and, for the offline API, as a progress bar."""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

from jaxinfer.engine.startup.compilation_cache import CompileCounter

logger = logging.getLogger(__name__)


class WarmupProgress:
    """Args:
    total: units of the warm-up.
    counter: the compile counter open around the warm-up.
    bar: show a progress bar (the offline API) as well as the log lines.
    log_every: the most seconds between two log lines (the last unit is always logged).
    """

    def __init__(self, total: int, counter: CompileCounter, bar: bool, log_every: float = 5.0):
        self.total = total
        self.counter = counter
        self.log_every = log_every
        self.start = time.perf_counter()
        self._logged = self.start
        self._bar = tqdm(total=total, desc="warm-up", unit="bucket") if bar else None

    def eta(self, done: int, elapsed: float) -> float | None:
        """Seconds left at the mean pace of the units done so far (None before the first)."""
        return elapsed / done * (self.total - done) if done else None

    def __call__(self, done: int, what: str) -> None:
        """Unit `done` (1-based) of `total` finished; `what` names it."""
        now = time.perf_counter()
        elapsed = now - self.start
        programs = self.counter.programs
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{what}, {programs} programs")
            if done == self.total:
                self._bar.close()
        if done == self.total or now - self._logged >= self.log_every:
            self._logged = now
            left = self.eta(done, elapsed)
            logger.info(
                "warm-up: %d/%d done (%s), %d programs (%d from the compilation cache), %.1f s%s",
                done,
                self.total,
                what,
                programs,
                self.counter.cache_hits,
                elapsed,
                "" if left is None or done == self.total else f", about {left:.0f} s left",
            )
