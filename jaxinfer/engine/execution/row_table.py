"""Rows of the per-request device arrays (the block table, the sampler's state), by request id:
the runner side's own bookkeeping, apart from the scheduler's."""

from __future__ import annotations


class RowTable:
    """Hands out rows 0..capacity-1 to running requests; row `capacity` (the last) belongs to
    padding requests and is never handed out."""

    def __init__(self, capacity: int):
        self.padding_row = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self._synced: dict[str, int] = {}  # leading blocks already in the block-table row

    def assign(self, request_id: str) -> int:
        """A fresh row for a request that starts (or resumes) running."""
        assert request_id not in self._rows, f"{request_id} already holds a row"
        row = self._rows[request_id] = self._free.pop()
        self._synced[request_id] = 0
        return row

    def row(self, request_id: str) -> int:
        return self._rows[request_id]

    def release(self, request_id: str) -> None:
        """Frees a request's row (unknown ids: nothing held)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)
            del self._synced[request_id]

    def synced_blocks(self, request_id: str) -> int:
        return self._synced[request_id]

    def set_synced_blocks(self, request_id: str, count: int) -> None:
        self._synced[request_id] = count

    def __len__(self) -> int:
        return len(self._rows)
