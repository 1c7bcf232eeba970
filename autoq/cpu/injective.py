"""A fixed schedule for the fused elementwise / pooling PrimFuncs around the int8 kernels.

TVM's default CPU pipeline leaves every fused function (bias add + requantize + residual
add, pooling, padding, softmax, layer norm, a matmul of two activations, ...) as a naive,
single-threaded loop nest. :func:`schedule_fused` gives each one the same cheap schedule:
intermediate blocks inlined where possible (never into a reduction, whose inner loop would
recompute them, with transposes or exps, on every step, and never a large integer expression into another, see
``MAX_INLINE_INT64_NODES``), reductions vectorized and register
blocked by :func:`autoq.ir.loop_schedule.schedule_reductions`, then every remaining block
parallel over its leading spatial loops (the innermost loop is left to LLVM's vectorizer;
when it reads ``x[..., i // k]``, a fused nearest-neighbour upsampling, it is split by ``k``
and the ``k`` copies unrolled; a block reading only its own element of same-shape tensors
runs its rows or planes in explicit 64- or 16-lane vectors instead). Semantics are
unchanged: every output keeps its reduction order, bit for bit.

:func:`memoized_kernel` is the cache of the kernel builders whose arguments are all
hashable (shapes as tuples, dtypes, ints): a model's layers of one shape build their kernel
once.
"""

from __future__ import annotations

import functools
import math

import tvm
from tvm import tirx
from tvm.s_tir import Schedule, ScheduleError

from autoq.cpu.int8_round_trip import elide_round_trips
from autoq.cpu.int_sum import schedule_integer_sum
from autoq.ir.loop_schedule import rows_for, schedule_reductions

__all__ = ["KERNEL_ATTR", "ScheduleFused", "memoized_kernel", "schedule_fused"]

KERNEL_ATTR = "autoq.kernel"  # PrimFuncs that already carry their own schedule
MIN_PARALLEL_ELEMENTS = 4096  # below this a thread-pool launch costs more than it saves
# lanes of an elementwise block's explicit vectors, widest first (64: four AVX-512 registers
# of float32; LLVM's own vectorizer stops at 256 bits on the AVX-512 targets, and at a
# row's tail)
ELEMENTWISE_LANES = (64, 16)
# a block with more int64 nodes is not inlined into a consumer with more: integer-mode
# requantizes with a general shift (80-170 nodes, nearly all int64 fixed-point arithmetic)
# inlined into each other made expressions the TIR simplifier took seconds over (MiniLM:
# 11 s for its embedding sum, before constant shifts became one add and one shift: ~30
# nodes per add, which inline); into a small consumer (a dequantize) they inline (keeping
# that one measured 17% faster on MiniLM); float chains always inline
MAX_INLINE_INT64_NODES = 48
# kernels a builder remembers (PrimFuncs are immutable: a repeated call returns the same one)
KERNELS_PER_BUILDER = 256


def memoized_kernel(builder):
    """``builder`` (a function of hashable arguments returning a PrimFunc) remembering its
    last ``KERNELS_PER_BUILDER`` results: a model's 24 per-token quantizes of one shape are
    one TVMScript parse instead of 24 (parsing is most of the lowering's time).

    >>> calls = []
    >>> build = memoized_kernel(lambda shape: calls.append(shape) or tirx.PrimFunc([], tirx.Evaluate(0)))
    >>> build((2, 3)) is build((2, 3)), calls
    (True, [(2, 3)])
    """
    return functools.wraps(builder)(functools.lru_cache(maxsize=KERNELS_PER_BUILDER)(builder))


def _blocks(sch: Schedule) -> list:
    """The blocks directly under the function's root block."""
    return sch.get_child_blocks(sch.get_sblock("root"))


def _extent(sch: Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext.value) if isinstance(ext, tirx.IntImm) else None


def _parallelize(sch: Schedule, block) -> None:
    """Fuse the block's leading data-parallel loops (all but the innermost) and run them on
    the thread pool when the block is big enough."""
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    n_spatial = 0
    for kind in kinds:
        if kind != tirx.IterVar.DataPar:
            break
        n_spatial += 1
    if len(loops) != len(kinds) or n_spatial == 0:
        return  # already transformed or not a plain TE loop nest: leave it
    lead = (
        loops[: n_spatial - 1] if n_spatial == len(loops) and n_spatial > 1 else loops[:n_spatial]
    )
    extents = [_extent(sch, lp) for lp in loops]
    if any(e is None for e in extents) or math.prod(extents) < MIN_PARALLEL_ELEMENTS:
        return
    sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])


_CHILDREN = ("a", "b", "value", "condition", "true_value", "false_value")


def _same_index(region, iter_vars) -> bool:
    """Whether a buffer region is the single element at exactly the block's iteration
    variables, in order."""
    if len(region.region) != len(iter_vars):
        return False
    for r, iv in zip(region.region, iter_vars, strict=True):
        if not (r.min.same_as(iv.var) and isinstance(r.extent, tirx.IntImm) and r.extent == 1):
            return False
    return True


def _vectorize_elementwise(sch: Schedule, block) -> bool:
    """A block that reads and writes only the element at its own index (an elementwise op of
    tensors of one shape) with its last loop, or its last two fused (a plane: contiguous
    flat indices the simplifier recovers), in explicit vectors of the widest
    ``ELEMENTWISE_LANES`` dividing it, parallel over the rest; False (unchanged) for any
    other block or when no such width divides them."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if len(loops) != len(stmt.iter_vars) or not loops:
        return False
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars):
        return False
    if not all(_same_index(r, stmt.iter_vars) for r in (*stmt.reads, *stmt.writes)):
        return False
    extents = [_extent(sch, lp) for lp in loops]
    if any(e is None for e in extents):
        return False
    plan = next(
        (
            (tail, lanes)
            for lanes in ELEMENTWISE_LANES
            for tail in (1, 2)
            if tail <= len(loops) and math.prod(extents[-tail:]) % lanes == 0
        ),
        None,
    )
    if plan is None:
        return False
    tail, lanes = plan
    inner_loops = loops[-tail:]
    plane = sch.fuse(*inner_loops) if tail > 1 else inner_loops[0]
    inner = sch.split(plane, [None, lanes])[1]
    sch.vectorize(inner)
    if math.prod(extents) >= MIN_PARALLEL_ELEMENTS:
        lead = sch.get_loops(block)[:-1]
        sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])
    return True


def _divisors(expr, var, found: set) -> set:
    """Constant ``k`` of every ``var // k`` (truncating or floor) inside ``expr``."""
    if isinstance(expr, (tirx.Div, tirx.FloorDiv)) and expr.a.same_as(var):
        if isinstance(expr.b, tirx.IntImm) and expr.b.value > 1:
            found.add(int(expr.b.value))
    for name in _CHILDREN:
        child = getattr(expr, name, None)
        if isinstance(child, tvm.ir.expr.Expr):
            _divisors(child, var, found)
    for child in getattr(expr, "args", None) or ():
        if isinstance(child, tvm.ir.expr.Expr):
            _divisors(child, var, found)
    return found


def _unroll_upsampling(sch: Schedule, block) -> None:
    """A block reading ``x[..., i // k]`` along its innermost loop (nearest-neighbour
    upsampling by ``k``, fused into an elementwise function): split that loop by ``k`` and
    unroll the ``k`` copies, so that the read becomes contiguous in the outer loop and LLVM
    vectorizes it instead of computing a clamped division per element."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    if not loops or not stmt.iter_vars:
        return
    var = stmt.iter_vars[-1].var
    extent = _extent(sch, loops[-1])
    found: set = set()
    for region in stmt.reads:
        for r in region.region:
            _divisors(r.min, var, found)
    ks = [k for k in sorted(found) if extent and extent % k == 0 and extent > k]
    if len(ks) == 1:
        sch.unroll(sch.split(loops[-1], [None, ks[0]])[1])


def _int64_nodes(expr) -> int:
    """Nodes of int64 type in a TIR expression (the value a block stores)."""
    n = int(str(expr.ty) == "int64")
    for name in _CHILDREN:
        child = getattr(expr, name, None)
        if isinstance(child, tvm.ir.expr.Expr):
            n += _int64_nodes(child)
    for child in getattr(expr, "args", None) or ():
        if isinstance(child, tvm.ir.expr.Expr):
            n += _int64_nodes(child)
    return n


def _int64_size(sch: Schedule, block) -> int:
    body = sch.get(block).body
    return _int64_nodes(body.value) if isinstance(body, tirx.BufferStore) else 0


def _too_big_to_inline(sch: Schedule, block) -> bool:
    """Whether ``block`` and one of its consumers both have more than
    ``MAX_INLINE_INT64_NODES`` int64 nodes."""
    if _int64_size(sch, block) <= MAX_INLINE_INT64_NODES:
        return False
    return any(_int64_size(sch, c) > MAX_INLINE_INT64_NODES for c in sch.get_consumers(block))


def _feeds_reduction(sch: Schedule, block) -> bool:
    for consumer in sch.get_consumers(block):
        kinds = [iv.iter_type for iv in sch.get(consumer).iter_vars]
        if tirx.IterVar.CommReduce in kinds:
            return True
    return False


def schedule_fused(func: tirx.PrimFunc, rows: int = 4) -> tirx.PrimFunc:
    """``func`` with its blocks inlined where possible, its reductions scheduled
    (``rows``: vectors accumulated together, see :func:`autoq.ir.loop_schedule.rows_for`) and
    its blocks parallelized."""
    summed = schedule_integer_sum(func)
    if summed is not None:
        return summed
    try:
        sch = Schedule(func, error_render_level="none")
        blocks = _blocks(sch)
    except RuntimeError:  # ScheduleError, InternalError: no root block, not TE-built
        return func
    for block in blocks[:-1]:
        if _feeds_reduction(sch, block) or _too_big_to_inline(sch, block):
            continue
        try:
            sch.compute_inline(block)
        except ScheduleError:
            pass
    for block in _blocks(sch):
        elide_round_trips(sch, block)
    sch = Schedule(schedule_reductions(sch.mod["main"], rows), error_render_level="none")
    for block in _blocks(sch):
        try:
            if _vectorize_elementwise(sch, block):
                continue
            _parallelize(sch, block)
            _unroll_upsampling(sch, block)
        except ScheduleError:
            pass
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="autoq.ScheduleFused")
class ScheduleFused:
    """Module pass: :func:`schedule_fused` on every PrimFunc not marked with ``KERNEL_ATTR``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        rows = rows_for(target) if target is not None else 4
        updates = {}
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if func.attrs is not None and KERNEL_ATTR in func.attrs:
                continue
            updates[gv] = schedule_fused(func, rows)
        for gv, func in updates.items():
            mod[gv] = func
        return mod
