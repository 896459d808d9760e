"""Gives requests the KV-cache blocks their tokens need, on demand."""

from __future__ import annotations

from jaxinfer.engine.block_pool import BlockPool
from jaxinfer.engine.request import Request


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grows the request's blocks to hold num_computed_tokens + num_new_tokens; False if the
        pool cannot (nothing is allocated then)."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(missing))
        return True

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
