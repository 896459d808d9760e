"""How far the host may run ahead of a mesh of several CPU devices in one process.

XLA:CPU runs each device's share of a multi-device program as a task on its client thread
pool, which has max(cores, devices) threads: on a machine with fewer cores than devices, one
thread per device, all of which a collective needs at once. It also throttles each device to
32 programs in flight by blocking the task that launches the next one, on one of those same
threads. A host that dispatches further ahead than that (per-layer execution dispatches a
program per layer) leaves a thread blocked in the throttle while the devices that did start a
collective wait for the one whose share has no thread left to run on: a deadlock, which XLA
ends after 40 s by aborting the process ("Expected 3 threads to join the rendezvous, but only
2 of them arrived"). It shows under load, when the host outruns the devices most.

DispatchWindow keeps every device under the throttle: before dispatching past its window,
it waits for the program dispatched a window earlier.
"""

from __future__ import annotations

import collections

import jax
from jax.sharding import Mesh

XLA_CPU_MAX_INFLIGHT = 32  # XLA:CPU's programs in flight per device before the throttle
WINDOW = 16  # a step's layers in flight, leaving room for its other programs


def dispatch_window(mesh: Mesh) -> int | None:
    """The most per-layer programs a step may have in flight on `mesh`: WINDOW for several
    CPU devices of this process, None (no limit) otherwise."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(local) > 1 and local[0].platform == "cpu":
        return WINDOW
    return None


class DispatchWindow:
    """Tracks the outputs of the programs dispatched; with a limit, waits for the oldest once
    more than `limit` are outstanding."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._outstanding: collections.deque = collections.deque()

    def dispatched(self, output) -> None:
        """`output`: a result of the program just dispatched (not one donated later)."""
        if self.limit is None:
            return
        self._outstanding.append(output)
        while len(self._outstanding) > self.limit:
            jax.block_until_ready(self._outstanding.popleft())
