"""The LoRA slots' bookkeeping: adapters loaded into empty slots, then into the least recently
used idle one; never into a slot a running request uses (the request waits); a slot shared by
the requests of one adapter."""

from __future__ import annotations

from jaxinfer.engine.scheduling.lora_slots import LoraSlots, SlotAdapter


def _adapter(key: int) -> SlotAdapter:
    return SlotAdapter(key, f"a{key}", contents=f"weights {key}", key=key)


def test_least_recently_used_idle_slot_is_evicted_and_used_ones_never():
    loads = []
    slots = LoraSlots(2, lambda slot, contents: loads.append((slot, contents)))
    a, b, c = _adapter(1), _adapter(2), _adapter(3)
    assert slots.acquire(a) == 0 and slots.acquire(b) == 1
    assert slots.acquire(a) == 0  # shared: no load
    assert loads == [(0, "weights 1"), (1, "weights 2")]
    assert slots.acquire(c) is None  # both in use: c waits
    slots.release(1)  # b idle
    assert slots.acquire(c) == 1 and loads[-1] == (1, "weights 3")
    slots.release(0)
    assert slots.acquire(b) is None  # a still used once, c in use
    slots.release(0)  # a idle now
    slots.release(1)  # c idle, more recently than a
    assert slots.acquire(b) == 0  # a, the least recently used, leaves
    assert slots.slot_of == {3: 1, 2: 0} and slots.num_loads == 4
    assert slots.acquire(c) == 1 and slots.num_loads == 4  # still there: no load
    assert slots.num_active == 2
