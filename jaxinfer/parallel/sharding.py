"""Sharding declared once: rules from the model's logical axes to the mesh's axes.

Model code names logical axes only (PARAM_AXES in models/llama.py for the parameters, and
`Partitioner.constrain(x, axes)` for activations); these rules map them onto the "tp" mesh
axis. Under jit, XLA's partitioner (GSPMD) then splits every matmul and inserts the
collectives: one all-reduce after the O projection and one after the down projection of each
layer (both are split by rows), and an all-gather of the logits, which the sampler sees whole.
A MoE layer's experts are split within each expert ("expert_mlp") or, with expert parallelism,
whole experts per device ("experts"); jaxinfer.layers.moe.experts runs them under shard_map.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.parallel.mesh import TP_AXIS

# logical axis -> mesh axis (absent: replicated)
RULES: dict[str, str] = {
    "vocab": TP_AXIS,  # embedding and LM head: by vocabulary
    "kv_heads": TP_AXIS,  # fused QKV (grouped by KV head) and the KV cache: by KV head
    "q_heads": TP_AXIS,  # attention output: by query head
    "q_heads_x_dim": TP_AXIS,  # O projection: by rows (query head x head dim)
    "head_groups": TP_AXIS,  # DeepSeek-V4's grouped low-rank O projection: by head group
    "kv_heads_x_dim": TP_AXIS,  # a hybrid's K and V projections: by columns (KV head x dim)
    "linear_heads": TP_AXIS,  # a hybrid's linear layers: by key-head groups
    "mlp": TP_AXIS,  # gate/up by columns, down by rows
    "expert_mlp": TP_AXIS,  # each MoE expert's gate/up and down, as "mlp"
}
# Expert parallelism (EngineOptions.expert_parallel): whole experts per device instead.
EXPERT_PARALLEL_RULES: dict[str, str | None] = {"experts": TP_AXIS, "expert_mlp": None}

Axes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Partitioner:
    """Places arrays on a mesh by logical axes (static under jit: it is hashable)."""

    mesh: Mesh
    expert_parallel: bool = False  # a MoE model's experts by "experts", not "expert_mlp"

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def rules(self) -> dict[str, str | None]:
        return {**RULES, **EXPERT_PARALLEL_RULES} if self.expert_parallel else RULES

    def spec(self, axes: Axes, shape: tuple[int, ...] | None = None) -> PartitionSpec:
        """The mesh axes of logical `axes`; an axis that does not divide evenly by the mesh
        (a vocabulary of odd size, say) stays replicated."""
        names = []
        rules = self.rules
        for i, axis in enumerate(axes):
            mesh_axis = rules.get(axis) if axis is not None else None
            if mesh_axis is not None and shape is not None and shape[i] % self.size:
                mesh_axis = None
            names.append(mesh_axis)
        return PartitionSpec(*names)

    def sharding(self, axes: Axes, shape: tuple[int, ...] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        """Pins an activation's layout inside jit (a no-op on one device)."""
        if self.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))

    def place(self, value: Any, axes: Axes) -> jax.Array:
        """Host (or device) array -> sharded device array; each device gets only its part."""
        return jax.device_put(value, self.sharding(axes, tuple(value.shape)))

    def zeros(self, shape: tuple[int, ...], dtype, axes: Axes | None = None) -> jax.Array:
        """Zeros created already sharded (never materialized whole on one device)."""
        sharding = self.sharding(axes, shape) if axes is not None else self.replicated
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

    def full(self, shape: tuple[int, ...], value, dtype) -> jax.Array:
        return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=self.replicated)()
