"""Prompts shared by scheduler and cache tests."""

from __future__ import annotations

SHARED_PREFIX = [(5 * i) % 300 + 3 for i in range(48)]


def prompts(count: int, prefix: list[int] = ()) -> list[list[int]]:
    return [
        list(prefix) + [(11 * i + 3 * j) % 300 + 3 for j in range(12 + 3 * i)] for i in range(count)
    ]
