"""A cheap default CPU schedule for the reductions of fused kernels (no search), used to
run calibration's simulated graph at compiled speed.

The default Relax CPU pipeline compiles every kernel as TE wrote it: a conv2d is
``for n, oc, oh, ow: for ic, kh, kw: acc += ...`` with nothing vectorized or parallel, so
the simulated graph of a ResNet-50 runs ~35x slower than ONNX Runtime. For every block
with reduction axes, :func:`schedule_reductions` moves the innermost spatial loop *inside*
the reduction loops (split by the widest of 16/8/4 lanes that divides it, vectorized) and
runs the outer spatial loops in parallel. Each output element is still accumulated by one
lane of one thread, in the same reduction order: the results are identical bit for bit to
the unscheduled kernel (tested), so calibrated qparams do not change.

>>> import tvm
>>> from tvm import relax
>>> from autoq.loop_schedule import pipeline_with_loop_schedule
>>> target = tvm.target.Target({"kind": "llvm"})
>>> pipeline = pipeline_with_loop_schedule(target)   # a module pass for tvm.compile
"""

from __future__ import annotations

import tvm

from .cpu_pipeline import unfused_pipeline

__all__ = ["pipeline_with_loop_schedule", "schedule_module", "schedule_reductions"]

_LANES = (16, 8, 4)
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


def _schedule_block(sch, block) -> bool:
    found = _plain_loops(sch, block)
    if found is None:
        return False
    spatial, reduce = found
    last = spatial[-1]
    extent = sch.get(last).extent
    if not isinstance(extent, tvm.tirx.IntImm):
        return False
    lanes = next((f for f in _LANES if int(extent) % f == 0), None)
    if lanes is None:  # e.g. a 7x7 feature map: one vector of the whole row
        if int(extent) > 32:
            return False
        lanes = int(extent)
    outer, inner = sch.split(last, [None, lanes])
    sch.reorder(*spatial[:-1], outer, *reduce, inner)
    par = [*spatial[:-1], outer]
    sch.parallel(sch.fuse(*par) if len(par) > 1 else par[0])
    sch.vectorize(inner)
    sch.decompose_reduction(block, reduce[0])
    return True


def schedule_reductions(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with each plain reduction block scheduled as the module docstring says
    (unchanged when it has none, or when a step does not apply)."""
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
            changed |= _schedule_block(sch, block)
        except tvm.s_tir.ScheduleError:
            return func
    return sch.mod["main"] if changed else func


def schedule_module(mod: tvm.IRModule) -> tvm.IRModule:
    """Every PrimFunc of ``mod`` through :func:`schedule_reductions`."""
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, f in list(mod.functions_items()):
        if isinstance(f, tvm.tirx.PrimFunc):
            mod[gv] = schedule_reductions(f)
    return mod


def pipeline_with_loop_schedule(target):
    """``tvm.compile``'s own default pipeline (legalization, no fusion) with
    :func:`schedule_reductions` applied to every kernel: the same kernels, the same
    arithmetic, faster (a module pass for ``tvm.compile(..., relax_pipeline=...)``)."""
    return unfused_pipeline(target, schedule_module)
