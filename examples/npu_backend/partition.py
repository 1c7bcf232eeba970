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

from .codegen import CODEGEN

__all__ = ["build", "host_ops", "partition"]


def partition(mod: tvm.IRModule, supported=None) -> tvm.IRModule:
    """``mod`` with every supported layer in a composite function and adjacent composites
    merged into one ``Codegen="autoq_npu"`` function per region (no codegen run yet)."""
    table = autoq.byoc.pattern_table(CODEGEN, supported)
    mod = relax.transform.FuseOpsByPattern(table, bind_constants=False, annotate_codegen=False)(mod)
    return relax.transform.MergeCompositeFunctions()(mod)


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
