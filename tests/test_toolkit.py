"""autoq.ir.toolkit's worked examples (its doctests: reading expressions, read_counts)."""

import doctest

from autoq.ir import toolkit


def test_doctests():
    assert doctest.testmod(toolkit).failed == 0
