"""Index-order sums of a block of rows, interleaved: ``ROW_BLOCK`` independent chains of
adds (the index-order sum of one row alone is a chain of dependent adds, bound by the add
latency), the same adds in the same order as one row at a time, so the same floats as
TVM's own reductions. Used by :mod:`autoq.cpu.softmax` (the exponentials' sum) and
:mod:`autoq.cpu.layer_norm` (the mean and variance sums of rows that are not a whole
block of whole vectors; a whole block runs them as vector adds of a transposed copy,
:mod:`autoq.cpu.lane_transpose`).
"""

from __future__ import annotations

from tvm.script import tirx as T

__all__ = ["ROW_BLOCK", "row_sums"]

ROW_BLOCK = 16  # rows whose index-order sums run interleaved


@T.macro
def row_sums(sums, count, n, term):
    """``sums[r] = ((0 + term(r, 0)) + term(r, 1)) + ... + term(r, n - 1)`` for the
    ``count`` (at most ``ROW_BLOCK``) rows of a block, the rows' chains interleaved (the
    block's rows unrolled inside the loop over ``k``); ``term(r, k)``: a Python function
    giving the float32 addend of row ``r`` of the block at index ``k``."""
    for r in range(count):
        sums[r] = T.float32(0)
    for k in range(n):
        for r in T.unroll(ROW_BLOCK):
            if r < count:
                sums[r] = sums[r] + term(r, k)
