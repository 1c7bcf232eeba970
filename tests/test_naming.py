"""autoq.naming.unique_name: the one rule for new tensor names in the ONNX graphs autoq
writes (export) and rewrites (recurrent unrolling)."""

from __future__ import annotations

import doctest

from hypothesis import given
from hypothesis import strategies as st

import autoq.naming as naming
from autoq.naming import unique_name


def test_doctests():
    assert doctest.testmod(naming).failed == 0


@given(st.lists(st.sampled_from(["x", "x_1", "y", "", "x_1_1"]), max_size=30))
def test_names_never_repeat_and_keep_a_free_base(bases):
    """Whatever was taken before (a model input named like a generated name, ``x_1``, is
    the edge case), every new name is unused, recorded, and ``base`` itself when free."""
    taken = {"x_1"}
    seen = set(taken)
    for base in bases:
        free = base not in taken
        name = unique_name(base, taken)
        assert name not in seen and name in taken
        assert (name == base) == free and name.startswith(base)
        seen.add(name)
