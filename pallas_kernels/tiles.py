"""Tile sizes shared by the Pallas kernels."""

from __future__ import annotations


def largest_power_of_two_divisor(n: int, cap: int) -> int:
    """The largest power of two up to `cap` that divides `n`."""
    size = 1
    while size * 2 <= cap and n % (size * 2) == 0:
        size *= 2
    return size
