"""Value checks shared by every validator (configuration, on-disk records, wire documents)."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """A true int: `bool` is an int subclass in Python, but True is never a step, rank or size."""
    return isinstance(value, int) and not isinstance(value, bool)
