"""Counting XLA compilations while a test runs (what warm-up should have compiled already)."""

from __future__ import annotations

import contextlib

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that gains one entry (its seconds) per backend compilation inside."""
    compiles: list[float] = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
