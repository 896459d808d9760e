"""Several hosts: jax.distributed joins the processes so one mesh spans every host's devices.

Process 0 decides everything the processes must agree on (jaxinfer.engine.lockstep sends it
the rest of the way); what is drawn once at start-up is broadcast here.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Args:
    coordinator_address: "host:port" of process 0's coordinator service ("[v6]:port").
    num_processes: processes in the job (one per host, usually).
    process_id: this process's index, 0 .. num_processes - 1.
    control_host: the address process 0's control channel (jaxinfer.parallel.channel) binds
        to and the others connect to; None: the coordinator's host, process 0 binding the
        interface that address routes over.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    control_host: str | None = None

    def __post_init__(self):
        given = [
            v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)
        ]
        if any(given) and not all(given):
            raise ValueError("--coordinator_address, --num_processes and --process_id go together")
        if self.control_host is not None and not all(given):
            raise ValueError("--control_host is for jobs of several processes")
        if all(given) and not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes}), got {self.process_id}"
            )

    @property
    def enabled(self) -> bool:
        return self.coordinator_address is not None

    @property
    def coordinator_host(self) -> str:
        return self.coordinator_address.rsplit(":", 1)[0].strip("[]")

    @property
    def coordinator_port(self) -> int:
        return int(self.coordinator_address.rsplit(":", 1)[1])

    @property
    def control_connect_host(self) -> str:
        """Where the other processes reach process 0's control channel."""
        return self.control_host or self.coordinator_host


def initialize(config: DistributedConfig, recoverable: bool = False) -> None:
    """Joins the job (before anything touches a device); a no-op for a single process.

    CPU devices of different processes exchange collectives through gloo (over TCP).

    recoverable: JAX's coordinator, in process 0, then lets a process die without aborting
    the others (after its heartbeat timeout): their collectives fail at once instead, so the
    server reports the failure (in-flight requests fail, /health is 503). There is then no
    shutdown barrier: the processes must leave in order (jaxinfer.engine.lockstep does).
    Without it (a script every process runs through the LLM API), JAX's shutdown barrier
    makes the processes leave together."""
    if not config.enabled:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", recoverable)
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
    )


def gather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (int32[n], the same n everywhere), as int32[processes, n] on every
    process. Works whatever the processes' device counts (multihost_utils needs them equal):
    each process places its row on its first device and zeros on the others, and one program
    replicates the [devices, n] array."""
    row = np.asarray(row, np.int32)
    if jax.process_count() == 1:
        return row[None]
    devices = jax.devices()
    mesh, replicate = _replicator(tuple(devices))
    first = {}
    for index, device in enumerate(devices):
        first.setdefault(device.process_index, index)
    mine = first[jax.process_index()]
    shards = [
        jax.device_put(row[None] if devices.index(d) == mine else np.zeros_like(row[None]), d)
        for d in jax.local_devices()
    ]
    spread = jax.make_array_from_single_device_arrays(
        (len(devices), row.size), NamedSharding(mesh, PartitionSpec("all")), shards
    )
    whole = replicate(spread)
    rows = np.asarray(whole.addressable_data(0))  # [devices, n]
    return rows[[first[p] for p in range(jax.process_count())]]


@functools.cache
def _replicator(devices: tuple) -> tuple[Mesh, Callable]:
    """The mesh of all devices and a program that replicates an array over it (compiled once
    per shape)."""
    mesh = Mesh(np.array(devices), ("all",))
    return mesh, jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def broadcast_from_leader(values: np.ndarray) -> np.ndarray:
    """Process 0's `values` (int32[n], the same n everywhere), on every process."""
    return gather_rows(values)[0]


def seed_root(seed: int | None) -> int:
    """The root of the seeds of requests that set none: `seed`, or a number drawn once on
    process 0 and shared with every process (so their samples agree)."""
    if seed is not None:
        return seed
    drawn = np.frombuffer(secrets.token_bytes(8), np.uint16).astype(np.int32)  # 4 x 16 bits
    shared = broadcast_from_leader(drawn)
    return sum(int(part) << (16 * i) for i, part in enumerate(shared))
