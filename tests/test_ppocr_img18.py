"""benchmarks/ppocr_img18.py's set search (``minimal_set``) against brute force over every
subset of a small universe: the set it returns is good, no element can be dropped from it,
and its last element closes the shortest good prefix."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from ppocr_img18 import minimal_set


def _monotone(rng, n):
    """A random monotone predicate: some union of 1-3 random 'sufficient' sets."""
    bases = [set(rng.choice(n, size=rng.integers(1, 4), replace=False).tolist()) for _ in range(3)]
    return (lambda s: any(b <= set(s) for b in bases)), bases


@pytest.mark.parametrize("seed", range(20))
def test_minimal_set_is_good_and_irredundant(seed):
    rng = np.random.default_rng(seed)
    n = 9
    good, bases = _monotone(rng, n)
    calls = []
    found, distinct = minimal_set(range(n), lambda s: calls.append(tuple(s)) or good(s))
    assert good(found)
    assert found == sorted(found)
    for x in found:  # brute force: no element can be dropped
        assert not good([y for y in found if y != x])
    assert distinct == len(set(map(frozenset, calls)))  # each set evaluated once
    smallest = min(
        len(c) for k in range(n + 1) for c in itertools.combinations(range(n), k) if good(c)
    )
    assert len(found) >= smallest
    # its last element closes the shortest good prefix of the items
    assert found[-1] == min(k for k in range(n) if good(range(k + 1)))
    if any(len(b) == 1 for b in bases) and len(found) == 1:
        assert {found[0]} in bases


def test_minimal_set_needs_a_good_whole():
    with pytest.raises(ValueError, match="good"):
        minimal_set(range(4), lambda s: False)
