"""Which LoRA adapter each device slot holds (S-LoRA's adapter paging, at the scheduler).

A request with an adapter is admitted only with its adapter in a slot: one already holding
it, an empty one, or else the least recently used slot whose adapter no running request
uses (evicted; an adapter unloaded from the server stays in its slot until then). When none is left the request waits, and later ones may go first; an adapter
in use is never evicted. Loading writes the slot on the device after the steps already
dispatched (ModelRunner.load_lora), so nothing in flight sees it change.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True, eq=False)
class SlotAdapter:
    """An adapter ready for a slot: what the slot takes (on the device already:
    jaxinfer.layers.lora.slot_contents, placed), its id and name as the user gave them, and
    `key`, unique to this reading of it: slots and prefix-cache entries are keyed by it, so an
    id unloaded and loaded again with other weights never meets the old ones."""

    id: int
    name: str
    contents: Any
    key: int


class AdapterUser(Protocol):
    """What LoraSlots.take and drop read of a request (jaxinfer.engine.scheduling.request)."""

    lora: SlotAdapter | None
    lora_slot: int  # the adapter's slot while it runs (-1: none)


class LoraSlots:
    def __init__(self, num_slots: int, load: Callable[[int, Any], None]):
        """`load(slot, contents)`: writes an adapter into a slot on the device."""
        self._load = load
        self.slot_of: dict[int, int] = {}  # adapter key -> slot
        self.holder: list[int | None] = [None] * num_slots
        self.users = [0] * num_slots
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._empty = list(range(num_slots))
        self.num_loads = 0

    def acquire(self, adapter: SlotAdapter) -> int | None:
        """The slot holding `adapter` for one more request, loaded if needed; None if every
        slot holds an adapter in use."""
        slot = self.slot_of.get(adapter.key)
        if slot is None:
            if self._empty:
                slot = self._empty.pop(0)
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                del self.slot_of[self.holder[slot]]
            else:
                return None
            self._load(slot, adapter.contents)
            self.num_loads += 1
            self.holder[slot], self.slot_of[adapter.key] = adapter.key, slot
        self._idle.pop(slot, None)
        self.users[slot] += 1
        return slot

    def take(self, request: AdapterUser) -> bool:
        """Whether the request may run: it has no adapter, or its adapter got a slot (then
        request.lora_slot)."""
        if request.lora is None:
            return True
        slot = self.acquire(request.lora)
        request.lora_slot = -1 if slot is None else slot
        return slot is not None

    def drop(self, request: AdapterUser) -> None:
        """The request gives back its adapter's slot, if it holds one."""
        if request.lora_slot >= 0:
            self.release(request.lora_slot)
            request.lora_slot = -1

    def release(self, slot: int) -> None:
        """One request fewer uses `slot`; unused, it is the most recently used idle slot."""
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None

    @property
    def num_active(self) -> int:
        """Slots some running request uses."""
        return sum(1 for users in self.users if users)
