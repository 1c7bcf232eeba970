"""A cheap default CPU schedule for the reductions of fused kernels (no search), used to
run calibration's simulated graph at compiled speed.

The default Relax CPU pipeline compiles every kernel as TE wrote it: a conv2d is
``for n, oc, oh, ow: for ic, kh, kw: acc += ...`` with nothing vectorized or parallel, so
the simulated graph of a ResNet-50 runs ~35x slower than ONNX Runtime. For every block
with reduction axes, :func:`schedule_reductions` moves the innermost spatial loop *inside*
the reduction loops (split into vectors, :func:`lanes_for`), accumulates 4 or 8 such
vectors of neighbouring output rows (a conv's output channels, a matmul's rows) together so
that one load of the input serves them all, and runs the outer spatial loops in parallel.
The copies next to a reduction (a conv's padding, a transposed conv's dilation and padding)
are vectorized and run in parallel too, the dilation inlined into the padding.
Each output element is still accumulated by one
lane of one thread, in the same reduction order: the results are identical bit for bit to
the unscheduled kernel (tested), so calibrated qparams do not change.

>>> import tvm
>>> from tvm import relax
>>> from autoq.ir.loop_schedule import pipeline_with_loop_schedule
>>> target = tvm.target.Target({"kind": "llvm"})
>>> pipeline = pipeline_with_loop_schedule(target)   # a module pass for tvm.compile
"""

from __future__ import annotations

import tvm
from tvm.tirx.analysis import undefined_vars

from autoq.ir.any_shape import legalize_map
from autoq.ir.cpu_pipeline import unfused_pipeline

__all__ = [
    "lanes_for",
    "pipeline_with_loop_schedule",
    "rows_for",
    "schedule_module",
    "schedule_reductions",
]

_LANES = (16, 8)
_DATA_PAR, _REDUCE = 0, 2


def _plain_loops(sch, block) -> tuple[list, list] | None:
    """(spatial loops, reduction loops) of a block nested in one loop per iterator, in
    order and of the same extents (as TE emits them); None for anything else."""
    loops = sch.get_loops(block)
    ivars = list(sch.get(block).iter_vars)
    if len(loops) != len(ivars) or len(ivars) < 2:
        return None
    for lp, iv in zip(loops, ivars, strict=True):
        ext, dom = sch.get(lp).extent, iv.dom.extent
        if not (isinstance(ext, tvm.tirx.IntImm) and isinstance(dom, tvm.tirx.IntImm)):
            return None
        if int(ext) != int(dom):
            return None
    kinds = [int(iv.iter_type) for iv in ivars]
    if any(k not in (_DATA_PAR, _REDUCE) for k in kinds) or _REDUCE not in kinds:
        return None
    spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == _DATA_PAR]
    reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k == _REDUCE]
    if not spatial or kinds.index(_REDUCE) < len(spatial):
        return None  # reduction loops must come after the spatial ones
    return spatial, reduce


def _schedule_block(sch, block, n_rows: int) -> bool:
    found = _plain_loops(sch, block)
    if found is None:
        return False
    spatial, reduce = found
    last = spatial[-1]
    extent = sch.get(last).extent
    if not isinstance(extent, tvm.tirx.IntImm):
        return False
    lanes = lanes_for(int(extent))
    if lanes is None:
        return False
    outer, inner = sch.split(last, [None, lanes])
    rows = _row_block(sch, block, spatial[:-1], n_rows)
    if rows is None:
        sch.reorder(*spatial[:-1], outer, *reduce, inner)
        par = [*spatial[:-1], outer]
    else:
        # n_rows rows of vectors accumulate together: one load of the input vector serves
        # all of them (a conv: n_rows output channels)
        i, loop = rows
        row_outer, row_inner = sch.split(loop, [None, n_rows])
        others = [*spatial[:i], row_outer, *spatial[i + 1 : -1]]
        sch.reorder(*others, outer, *reduce, row_inner, inner)
        sch.unroll(row_inner)
        par = [*others, outer]
    sch.parallel(sch.fuse(*par) if len(par) > 1 else par[0])
    sch.vectorize(inner)
    sch.decompose_reduction(block, reduce[0])
    return True


def lanes_for(extent: int) -> int | None:
    """The vector width of a row of ``extent`` outputs: 16 or 8 when it divides the row (a
    whole AVX-512 / AVX2 register), else the row's largest divisor from 15 down to 4 (a
    30-wide row of PP-OCR det: two vectors of 15, not one of 30: its 1x1 192-channel conv
    ran 1.9 -> 44 GMAC/s on one Sapphire Rapids core; 28-wide: 14 lanes, not 4, a 3x3
    128-channel conv 25 -> 60 GMAC/s), else the whole
    row when it is at most 32 (a 7x7 map), else None (left unscheduled). 16 and 8 stay
    first: a 120-wide row ran faster in vectors of 8 than of 15."""
    lanes = next((f for f in _LANES if extent % f == 0), None)
    lanes = lanes or next((f for f in range(15, 3, -1) if extent % f == 0), None)
    if lanes is None and extent <= 32:
        lanes = extent
    return lanes


def _row_block(sch, block, loops, n_rows: int) -> tuple[int, object] | None:
    """(index, loop): the outer spatial loop whose rows share the vector loads, with the
    largest extent divisible by ``n_rows`` (> ``n_rows``), or None. A loop shares them when
    its variable indexes no buffer that the innermost spatial loop (the vector) indexes:
    a conv's output channels (the input row serves them all), a matmul's rows (the row of
    B), not a conv's output rows (each its own input row: a 96 -> 24 channel 3x3 conv on
    120x120 ran 13 GMAC/s with rows of ``yy``, 21 with rows of output channels; 24 -> 16 on
    240x240 16 -> 47) nor a batched matmul's batch. None share them (a depthwise conv): the
    largest of all."""
    stmt = sch.get(block)
    ivars = [iv.var for iv in stmt.iter_vars][: len(loops) + 1]
    written = [w.source for w in stmt.writes]
    shared = [True] * len(loops)
    for read in stmt.reads:  # the inputs, not the accumulator
        if any(read.source.same_as(b) for b in written):
            continue
        used = [v for r in read.region for v in undefined_vars(r.min)]
        if any(v.same_as(ivars[-1]) for v in used):
            for i, iv in enumerate(ivars[:-1]):
                shared[i] = shared[i] and not any(v.same_as(iv) for v in used)
    best = None
    for i, lp in enumerate(loops):
        ext = sch.get(lp).extent
        if isinstance(ext, tvm.tirx.IntImm) and int(ext) % n_rows == 0 and int(ext) > n_rows:
            key = (shared[i], int(ext))
            if best is None or key > best[2]:
                best = (i, lp, key)
    return None if best is None else best[:2]


def schedule_reductions(func: tvm.tirx.PrimFunc, rows: int = 4) -> tvm.tirx.PrimFunc:
    """``func`` with each plain reduction block scheduled as the module docstring says
    (``rows`` vectors accumulated together; unchanged when it has no reduction, or when a
    step does not apply)."""
    if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
        return func
    try:
        sch = tvm.s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:
        return func
    changed = False
    for block in blocks:
        try:
            changed |= _schedule_block(sch, block, rows)
        except tvm.s_tir.ScheduleError:
            return func
    if changed:
        for block in blocks:
            _schedule_copy(sch, block)
    return sch.mod["main"] if changed else func


def _elementwise(sch, block) -> bool:
    return all(int(iv.iter_type) == _DATA_PAR for iv in sch.get(block).iter_vars)


def _copied(value) -> bool:
    """Whether ``value`` is a load or a constant picked by conditions (no float arithmetic
    that a vector instruction or LLVM's contraction could round otherwise)."""
    if isinstance(value, tvm.ir.expr.TensorLoad | tvm.tirx.FloatImm | tvm.tirx.IntImm):
        return True
    if isinstance(value, tvm.ir.expr.Call) and value.op.same_as(tvm.ir.Op.get("prim.if_then_else")):
        return _copied(value.args[1]) and _copied(value.args[2])
    return (
        isinstance(value, tvm.tirx.Select)
        and _copied(value.true_value)
        and _copied(value.false_value)
    )


def _schedule_copy(sch, block) -> None:
    """A kernel's elementwise block next to its reduction (a conv's padding, a transposed
    conv's dilation and padding) with its innermost loop vectorized and the outer ones run
    in parallel (when :func:`lanes_for` has a width for its row), or inlined into the
    elementwise block that reads it (the dilation into the padding: one pass, not two):
    each element still gets its one value (a copy or the +0.0 of the padding), so the bits
    cannot change. PP-OCR det's 24 -> 1 channel 2x2 stride-2
    transposed conv to 480x480 ran 7.6 -> 5.3 ms on one core, its 24 -> 24 to 240x240
    3.1 -> 2.6 ms."""
    body = sch.get(block).body
    if not (_elementwise(sch, block) and isinstance(body, tvm.tirx.BufferStore)):
        return
    if not _copied(body.value):
        return
    consumers = sch.get_consumers(block)
    if consumers and all(_elementwise(sch, c) for c in consumers):
        try:
            sch.compute_inline(block)
            return
        except tvm.s_tir.ScheduleError:
            pass
    loops = sch.get_loops(block)
    if len(loops) != len(sch.get(block).iter_vars) or len(loops) < 2:
        return
    extent = sch.get(loops[-1]).extent
    lanes = lanes_for(int(extent)) if isinstance(extent, tvm.tirx.IntImm) else None
    if lanes is None:
        return
    try:
        _outer, inner = sch.split(loops[-1], [None, lanes])
        sch.parallel(sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0])
        sch.vectorize(inner)
    except tvm.s_tir.ScheduleError:
        return


def schedule_module(mod: tvm.IRModule, rows: int = 4) -> tvm.IRModule:
    """Every PrimFunc of ``mod`` through :func:`schedule_reductions`."""
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, f in list(mod.functions_items()):
        if isinstance(f, tvm.tirx.PrimFunc):
            mod[gv] = schedule_reductions(f, rows)
    return mod


def rows_for(target) -> int:
    """Vectors accumulated together: 8 with AVX-512's 32 registers, else 4 (measured on a
    3x3 conv, 256 channels 14x14 + 64 channels 56x56: AVX-512 8 rows 27 ms vs 4 rows 39 ms;
    AVX2 4 rows 77 ms vs 8 rows 99 ms)."""
    from tvm.target import codegen

    if target.kind.name == "llvm" and target.attrs.get("mcpu", ""):
        if codegen.target_has_features("avx512f", target):
            return 8
    return 4


def pipeline_with_loop_schedule(target):
    """``tvm.compile``'s own default pipeline (legalization, no fusion) with
    :func:`schedule_reductions` applied to every kernel: the same kernels, the same
    arithmetic, faster (a module pass for ``tvm.compile(..., relax_pipeline=...)``); the
    elementwise ops get one kernel per rank (and broadcast), not per shape
    (:mod:`autoq.ir.any_shape`: the same bits, fewer kernels to compile)."""
    rows = rows_for(target)
    schedule = lambda mod: schedule_module(mod, rows)  # noqa: E731
    return unfused_pipeline(target, schedule, "autoq.LoopSchedule", legalize_map())
