"""The pool of KV-cache blocks, with reference counts and a prefix cache.

Block 0 is the null block: padding tokens write there and it is never handed out. A full block
can carry the hash of its contents (see kv_cache_manager.block_hashes); a freed block keeps its
hash and stays findable until it is needed for something else, in least-recently-freed order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"the pool needs at least 2 blocks (one is the null block): {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens
        # Blocks no request holds, oldest first; those with a hash are still cache hits.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # Told the hash of each cached block evicted (what is kept with it goes too).
        self.on_evict: Callable[[bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks (reference count 1); evicts the least recently freed."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Takes a reference to cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block; pass them tail first, so a request's last
        (least shared) blocks are evicted before its first ones."""
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Records that `block` holds the tokens of `block_hash` (first holder wins)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def reset_cache(self) -> bool:
        """Forgets every cached prefix; only while no block is held (False otherwise)."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _evict(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
            if self.on_evict is not None:
                self.on_evict(block_hash)
