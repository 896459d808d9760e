"""Several hosts: jax.distributed joins the processes so one mesh spans every host's devices."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: processes in the job (one per host, usually).
    process_id: this process's index, 0 .. num_processes - 1.
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        given = [
            v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)
        ]
        if any(given) and not all(given):
            raise ValueError("--coordinator_address, --num_processes and --process_id go together")
        if all(given) and not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes}), got {self.process_id}"
            )

    @property
    def enabled(self) -> bool:
        return self.coordinator_address is not None


def initialize(config: DistributedConfig) -> None:
    """Joins the job (before anything touches a device); a no-op for a single process."""
    if config.enabled:
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )
