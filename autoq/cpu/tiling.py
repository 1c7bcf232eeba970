"""Shared pieces of the fixed schedules: register-tile sizes and the tensorized inner loop."""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import Schedule

from autoq.cpu.intrinsics import register_intrinsics

__all__ = ["i64", "int32", "pick_tile", "tensorize_accumulation"]


def pick_tile(extent: int, largest: int = 8, slack: float = 0.0) -> int:
    """Register-tile size for a loop of ``extent`` (rows of the accumulator tile): the size
    in 4..largest that wastes the fewest padded iterations, larger on ties; the extent itself
    when it is smaller. ``slack``: the largest size whose padded extent is within that
    fraction of the fewest (a larger tile amortizes its loads and stores over more rows).

    >>> [pick_tile(n) for n in (1, 3, 7, 14, 28, 56, 112, 196, 13)]
    [1, 3, 7, 7, 7, 8, 8, 7, 7]
    >>> pick_tile(128, 6), pick_tile(128, 6, slack=0.05), pick_tile(14, 6, slack=0.05)
    (4, 6, 5)
    """
    if extent <= largest:
        return extent
    padded = {t: -(-extent // t) * t for t in range(largest, 3, -1)}
    least = min(padded.values())
    return next(t for t, p in padded.items() if p <= least * (1 + slack))


def i64(*dims: int) -> tuple:
    """A static shape as int64 immediates (the dtype Relax gives tensor shapes; FuseTIR
    refuses to fuse buffers whose shape dtypes differ)."""
    return tuple(tirx.IntImm("int64", int(d)) for d in dims)


def int32(v):
    """TE value widened to int32."""
    return v.astype("int32")


def tensorize_accumulation(sch: Schedule, block, reduce_loop, lane_loop, intrinsic: str) -> None:
    """Split the accumulation ``block`` into its zero-init (vectorized, placed before
    ``reduce_loop``) and its update, whose loops from ``lane_loop`` inward become one call
    of ``intrinsic``."""
    register_intrinsics()
    init = sch.decompose_reduction(block, reduce_loop)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(lane_loop, intrinsic)


def const_int(v) -> int:
    """A TIR immediate or int as a Python int."""
    return int(v.value) if isinstance(v, tirx.IntImm) else int(v)
