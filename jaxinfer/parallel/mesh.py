"""The device mesh of tensor parallelism, and which sizes a model can be split into."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.arch_config import LlamaConfig

TP_AXIS = "tp"


def valid_tp_sizes(arch: LlamaConfig, limit: int) -> list[int]:
    """Sizes up to `limit` that split the query heads evenly, and the KV heads evenly or by
    replication (fewer KV heads than devices: each is copied to tp / K devices, as vLLM does)."""
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    return [
        n
        for n in range(1, limit + 1)
        if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
    ]


def check_tp_size(arch: LlamaConfig, tp: int) -> None:
    if tp not in valid_tp_sizes(arch, tp):
        raise ValueError(
            f"tensor_parallel_size {tp} cannot split {arch.num_attention_heads} query heads "
            f"and {arch.num_key_value_heads} KV heads; sizes that work: "
            f"{valid_tp_sizes(arch, max(tp, 16))}"
        )


def kv_replicas(arch: LlamaConfig, tp: int) -> int:
    """How many copies of each KV head the model keeps (1 unless tp > KV heads; DeepSeek-V4's
    one K=V head is whole on every device, beside its split query heads)."""
    if arch.compressed is not None:
        return 1
    return max(1, tp // arch.num_key_value_heads)


def make_mesh(tp: int) -> Mesh:
    """A one-axis mesh ("tp") over the first tp devices (of every process, under
    jax.distributed)."""
    devices = jax.devices()
    if tp > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tp} needs {tp} devices; JAX sees {len(devices)} "
            f"({devices[0].platform})"
        )
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))
