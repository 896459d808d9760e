"""The pool of KV-cache blocks. Block 0 is the null block: padding tokens write there."""

from __future__ import annotations

from collections import deque

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"the pool needs at least 2 blocks (one is the null block): {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
