"""How many sequences (prompts x n) the server holds at once.

A request takes its count when it arrives, in one synchronous step on the event loop (so a
burst of concurrent requests cannot all pass the check before any is counted), and gives it
back when its response ends, however it ends.
"""

from __future__ import annotations

from jaxinfer.server.errors import APIError


class Ticket:
    def __init__(self, limiter: SequenceLimiter, count: int):
        self._limiter, self._count = limiter, count

    def release(self) -> None:
        """Idempotent."""
        if self._count:
            self._limiter.held -= self._count
            self._count = 0


class SequenceLimiter:
    """Args:
    limit: sequences held at most (None: no limit); beyond, requests get 503.
    """

    def __init__(self, limit: int | None):
        self.limit = limit
        self.held = 0

    def take(self, count: int) -> Ticket:
        if self.limit is not None and self.held + count > self.limit:
            raise APIError(
                503,
                f"the server holds {self.held} of at most {self.limit} sequences (prompts x n) "
                f"and this request adds {count}; retry later",
                "overloaded",
            )
        self.held += count
        return Ticket(self, count)
