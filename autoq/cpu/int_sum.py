"""A fixed schedule for fused integer sums over trailing axes (``qnn`` mean/sum, the global
average pool of a squeeze-excitation block: ``sum(int32(x) - zp)`` over H, W).

The generic fused-function schedule keeps the elementwise producer out of the reduction (it
would be recomputed per step of a matmul-like reduction) and vectorizes the innermost
*spatial* loop, which for a sum over H, W has extent 1: every element goes through scalar
code after an int32 copy of the whole input. Here the reduction reads each input element
exactly once, so the producers are inlined, and the innermost reduction loop is split into
``lanes`` partial sums (``rfactor``) accumulated as one vector, then added up. Integer
addition (wrapping int32/int64) is associative, so any order gives the same result bit for
bit; float sums are left alone. PP-OCRv4 det's 96x120x120 pool: 0.67 -> 0.055 ms (1 thread).
"""

from __future__ import annotations

from tvm import tirx
from tvm.s_tir import Schedule, ScheduleError

__all__ = ["schedule_integer_sum"]

_LANES = (16, 8, 4)


def _reads_each_element_once(block) -> bool:
    """Every input is read at distinct plain iteration variables covering all of the block's
    variables but those of extent 1 (a sum over axes, keepdims or not: no input element
    feeds two outputs or two steps, unlike a matmul's operands)."""
    needed = {iv.var.name for iv in block.iter_vars if not _is_one(iv.dom.extent)}
    allowed = {iv.var.name for iv in block.iter_vars}
    for region in block.reads:
        if region.source.same_as(block.writes[0].source):
            continue
        mins = [r.min for r in region.region]
        if not all(isinstance(m, tirx.Var) for m in mins):
            return False
        names = [m.name for m in mins]
        if len(set(names)) != len(names) or not needed <= set(names) <= allowed:
            return False
    return True


def _is_one(extent) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def schedule_integer_sum(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """``func`` scheduled as the module says when it is elementwise producers + one integer
    sum whose reduction loops are innermost, else None."""
    try:
        sch = Schedule(func, error_render_level="none")
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        red = blocks[-1]
        for block in blocks[:-1]:
            sch.compute_inline(block)
        stmt = sch.get(red)
        if stmt.init is None or len(stmt.writes) != 1:
            return None
        if not str(stmt.writes[0].source.dtype).startswith(("int", "uint")):
            return None
        if not _reads_each_element_once(stmt):
            return None
        kinds = [iv.iter_type for iv in stmt.iter_vars]
        n_spatial = kinds.count(tirx.IterVar.DataPar)
        n_reduce = len(kinds) - n_spatial
        loops = sch.get_loops(red)
        plain = [tirx.IterVar.DataPar] * n_spatial + [tirx.IterVar.CommReduce] * n_reduce
        if len(loops) != len(kinds) or kinds != plain or n_spatial == 0 or n_reduce == 0:
            return None
        last = sch.get(loops[-1]).extent
        lanes = next((n for n in _LANES if isinstance(last, tirx.IntImm) and int(last) % n == 0), 0)
        if lanes == 0:
            return None
        _, inner = sch.split(loops[-1], [None, lanes])
        rf = sch.rfactor(inner, n_spatial)
        rf_loops = sch.get_loops(rf)
        sch.parallel(sch.fuse(*rf_loops[:n_spatial]))
        sch.vectorize(sch.get_loops(rf)[-1])
        sch.decompose_reduction(rf, sch.get_loops(rf)[1])
    except (ScheduleError, RuntimeError):
        return None
    return sch.mod["main"]
