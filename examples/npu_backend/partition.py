"""Partition an autoq int8 module for the pretend NPU, build it, and count what stayed on the host.

The pretend NPU supports the accumulating layers (conv2d/dense/matmul + bias + residual +
requantize, average pool, global sum), elementwise add/subtract/multiply, table-lookup
activations, requantize, relu/clip, max pool, pad, concat, data movement, and the
quantize/dequantize at the model's edges: every row of ``autoq.byoc.SHAPES``. A backend
that supports less passes ``supported`` (names of shapes); the rest stays on the host.
"""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

import autoq.byoc
from autoq.ir.toolkit import const_array

from .codegen import CODEGEN

__all__ = ["build", "host_ops", "partition"]


def partition(mod: tvm.IRModule, supported=None) -> tvm.IRModule:
    """``mod`` with every supported layer in a composite function and adjacent composites
    merged into one ``Codegen="autoq_npu"`` function per region (no codegen run yet)."""
    table = autoq.byoc.pattern_table(CODEGEN, supported)
    mod = relax.transform.FuseOpsByPattern(table, bind_constants=False, annotate_codegen=False)(mod)
    return _inline_scalars(relax.transform.MergeCompositeFunctions()(mod))


def _inline_scalars(mod: tvm.IRModule) -> tvm.IRModule:
    """Each region with its scalar constant arguments (per-tensor scales, zero points) bound
    into the function instead of passed: the kernel sees them as immediates, as the integer
    rounding modes need (an ``add``'s multipliers are computed from its scales when it is
    lowered); tensors (weights, tables, per-channel qparams) stay arguments (module doc of
    :mod:`.codegen`: a TIR kernel holds no tensor constant)."""
    regions, calls, swaps = _offloaded(mod), {}, {}
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            if isinstance(b.value, tvm.ir.Call) and b.value.op in regions:
                calls.setdefault(b.value.op, []).append(b.value)
    bb = relax.BlockBuilder(mod)
    for gv, sites in calls.items():
        if len(sites) != 1:  # a region called twice: keep its arguments as they are
            continue
        func, args = mod[gv], sites[0].args
        scalar = {
            p: a
            for p, a in zip(func.params, args, strict=True)
            if (v := const_array(a)) is not None and v.ndim == 0
        }
        if scalar:
            kept = [a for p, a in zip(func.params, args, strict=True) if p not in scalar]
            name = f"{gv.name_hint}_scalars"
            func = func.bind_params(scalar).with_attr("global_symbol", name)
            bound = bb.add_func(func, name)
            swaps[sites[0]] = relax.Call(bound, kept)
    out = bb.get()
    replaced = {site.op for site in swaps}
    funcs = {gv: f for gv, f in out.functions_items() if gv not in replaced}
    funcs[out.get_global_var("main")] = _replace_calls(out["main"], swaps)
    return tvm.IRModule(funcs, attrs=out.attrs)


def _replace_calls(main: relax.Function, swaps: dict) -> relax.Function:
    @relax.expr_functor.mutator
    class Swap(relax.PyExprMutator):
        def visit_call_(self, call):
            for old, new in swaps.items():
                if call.same_as(old):
                    return new
            return super().visit_call_(call)

    return Swap().visit_expr(main)


def build(mod: tvm.IRModule, target, supported=None):
    """Partition, run the ``relax.ext.autoq_npu`` codegen (offloaded regions) and compile
    the rest for ``target``: an executable for ``relax.VirtualMachine``."""
    if isinstance(target, dict):
        target = tvm.target.Target(target)
    part = partition(mod, supported)
    part = relax.transform.RunCodegen({CODEGEN: {"target": target}})(part)
    return tvm.compile(part, target)


def _offloaded(mod: tvm.IRModule) -> set:
    return {
        gv
        for gv, f in mod.functions_items()
        if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs
    }


def host_ops(partitioned: tvm.IRModule) -> Counter:
    """``Counter((op, dtype))`` of the ops ``main`` still runs on the host after
    :func:`partition` (calls of offloaded regions excluded); ``"regions"`` counts those."""
    regions = _offloaded(partitioned)
    out: Counter = Counter()
    for block in partitioned["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, tvm.ir.Call) and v.op in regions:
                out["regions"] += 1
            elif isinstance(v, tvm.ir.Call) and isinstance(v.op, tvm.ir.Op):
                ty = b.var.ty
                dtype = str(ty.dtype) if isinstance(ty, relax.TensorType) else "tuple"
                out[(v.op.name, dtype)] += 1
    return out
