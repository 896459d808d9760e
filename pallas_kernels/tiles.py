"""Tile sizes shared by the Pallas kernels."""

from __future__ import annotations


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def check_powers_of_two(kernel: str, **sizes: int) -> None:
    """A ValueError naming the first size that is not a power of two (Triton's tiles)."""
    for name, size in sizes.items():
        if size != next_power_of_two(size):
            raise ValueError(f"the {kernel} kernel needs a power-of-two {name}: {size}")


def largest_power_of_two_divisor(n: int, cap: int) -> int:
    """The largest power of two up to `cap` that divides `n`."""
    size = 1
    while size * 2 <= cap and n % (size * 2) == 0:
        size *= 2
    return size
