"""Unique tensor names for the ONNX graphs autoq writes (the export) and rewrites (the
recurrent-layer unrolling): one rule, so that both name their new tensors alike.

>>> taken = {"x", "x_1"}
>>> unique_name("x", taken), unique_name("y", taken), sorted(taken)
('x_2', 'y', ['x', 'x_1', 'x_2', 'y'])
"""

from __future__ import annotations

__all__ = ["unique_name"]


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... the first not in ``taken``; added to it."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
