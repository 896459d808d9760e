"""Measured ceilings of the current device: memory copy bandwidth and matmul rate."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def timed(fn, *args, repeats: int = 10, sample_s: float = 2e-3) -> float:
    """Median seconds per call of fn(*args) after one warm-up call. Each sample enqueues enough
    back-to-back calls to last about `sample_s` before waiting, so a GPU kernel of tens of
    microseconds is timed on the device rather than by the host's dispatch of one call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(1, min(512, int(sample_s / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy (read plus write counted)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)  # one read and one write per element
    return 2 * x.nbytes / timed(copy, x)


def read_bandwidth(num_bytes: int) -> float:
    """Bytes per second of a reduction that reads every byte once."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    return x.nbytes / timed(jax.jit(jnp.sum), x)


def memory_bandwidth() -> float:
    """The ceiling a memory-bound kernel is held to: on a GPU the device-to-device copy of
    1 GiB (what the issue names); on CPU the faster of a copy and a read of 128 MiB (XLA:CPU's
    elementwise copy runs on one thread and understates the memory system)."""
    if jax.default_backend() == "gpu":
        return copy_bandwidth(1 << 30)
    return max(copy_bandwidth(1 << 27), read_bandwidth(1 << 27))


def matmul_rate(size: int, dtype) -> float:
    """FLOP per second of a [size, size] x [size, size] matmul."""
    a = jnp.ones((size, size), dtype)
    return 2 * size**3 / timed(jax.jit(jnp.dot), a, a)
