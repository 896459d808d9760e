"""Prefix caching for a hybrid model: its linear-attention layers' states at block boundaries.

A prefix hit on a hybrid model needs the K/V of the prefix's blocks (attention layers) and the
recurrent states after the prefix's last token (linear layers), which a request's own slot has
long moved past. So when a step of a prompt ends exactly at a block boundary, the request's
states are copied into a checkpoint slot, found by the hash of the block that ends there (the
chained hash: the whole prefix, its cache salt). A later request whose prefix holds that block
restores the checkpoint into its own slot and computes from the boundary on.

The scheduler makes prompts' steps end at boundaries (KVCacheManager.align_chunk): at the last
one a hit can use, ((prompt length - 1) // block size) blocks; where the blocks a prompt
shares with earlier ones end (a system prompt: the next prompts hit there); and at the end of
each chunk that a token budget cuts short (rounded down to a boundary).

The device copies run in order with the steps (jaxinfer.engine.execution.batch_builder): a
step's checkpoints are written just before the next step runs, and the restores after them,
so a checkpoint reserved while scheduling one step can be used from the next step scheduled
on. Slots are few (CacheConfig.state_checkpoints) and reused least recently used first; a
checkpoint goes with its block when the block is evicted from the pool.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, LRU first
        self._pending: set[bytes] = set()  # reserved by a step not yet written
        self._free = list(range(num_slots - 1, -1, -1))
        # The checkpoint a running request is bound to write (its prompt's last usable
        # boundary): a request with the same prefix waits for it rather than recompute it.
        self._producing: dict[bytes, str] = {}

    def find(self, block_hash: bytes) -> int | None:
        """The slot of a written checkpoint (marked recently used), or None."""
        slot = self._slots.get(block_hash)
        if slot is None or block_hash in self._pending:
            return None
        self._slots.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot for the checkpoint at this block's end, written before the next step; None
        when it is there or on its way already."""
        if block_hash in self._slots:
            return None
        if self._free:
            slot = self._free.pop()
        else:  # the least recently used checkpoint makes room
            evicted, slot = self._slots.popitem(last=False)
            self._pending.discard(evicted)
        self._slots[block_hash] = slot
        self._pending.add(block_hash)
        return slot

    def written(self) -> None:
        """The checkpoints reserved so far are written by the time anything scheduled from
        now on runs (called as a step is scheduled)."""
        self._pending.clear()
        for block_hash in [h for h in self._producing if h in self._slots]:
            del self._producing[block_hash]

    def drop(self, block_hash: bytes) -> None:
        """The checkpoint at this block's end goes with the block (evicted from the pool)."""
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._pending.discard(block_hash)
            self._free.append(slot)

    def clear(self) -> None:
        """Forgets every checkpoint (the prefix cache is reset)."""
        for block_hash in list(self._slots):
            self.drop(block_hash)

    def will_produce(self, block_hash: bytes, request_id: str) -> None:
        self._producing.setdefault(block_hash, request_id)

    def producer(self, block_hash: bytes) -> str | None:
        """The running request bound to write this checkpoint, until it is written."""
        return self._producing.get(block_hash)

    def forget_producer(self, request_id: str) -> None:
        """The request leaves the running set (finished, aborted or preempted)."""
        for block_hash in [h for h, r in self._producing.items() if r == request_id]:
            del self._producing[block_hash]

    @property
    def usage(self) -> float:
        return len(self._slots) / self.num_slots
