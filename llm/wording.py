"""How messages say a count of things."""

from __future__ import annotations


def plural(noun: str, count: int) -> str:
    """`noun` as `count` of it reads: 'record' for 1, 'records' otherwise (0 records)."""
    return noun if count == 1 else noun + "s"
