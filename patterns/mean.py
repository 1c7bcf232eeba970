"""Accumulate ops of the allow-list (``mean``, 1x1 ``adaptive_avg_pool2d``): global pooling.

Built from the ``accumulate`` rows of :data:`autoq.ir.registry.ALLOW_LIST`.

Simulated::  acc = sum(q - zp, axes)  (integer-valued float32);  out = acc * (s / N)
Realized::   acc = qnn.sum(q, s, zp, axes) -> int32;  out = qnn.dequantize(acc, s / N, 0)
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.ir.allow_list import ALLOW_LIST
from autoq.ir.registry import Pattern, register
from autoq.ir.toolkit import dtype_of, shape_of


def _axes(g, nodes):
    call = g.value[nodes["root"]]
    shape = shape_of(nodes["data"])
    if shape is None:
        return None
    if call.op.name == "relax.mean":
        axes = call.attrs.axis
        axes = list(range(len(shape))) if axes is None else [int(a) % len(shape) for a in axes]
        return axes, bool(call.attrs.keepdims)
    a = call.attrs
    out = shape_of(nodes["root"])
    if a.layout != "NCHW" or out is None or tuple(out[2:]) != (1, 1):
        return None
    return [2, 3], True


def _make(op: str) -> Pattern:
    name = op.split(".")[-1]

    def build():
        x = wildcard()
        return is_op(op)(x), {"data": x}

    def check(g, nodes):
        x = nodes["data"]
        if not (isinstance(x, relax.Var) and g.is_data_dependent(x) and dtype_of(x) == "float32"):
            return "input is not a float32 activation"
        if _axes(g, nodes) is None:
            return "not a global average over static dims"
        return None

    def simulate(ctx, m):
        axes, keep = _axes(ctx.g, m.nodes)
        n = int(np.prod([shape_of(m["data"])[a] for a in axes]))
        x = ctx.activation(m["data"])
        acc = ctx.emit(relax.op.sum(x.centered, axis=axes, keepdims=keep))
        scale = ctx.emit(relax.op.divide(x.scale, relax.const(np.float32(n))))
        return qnn.simulated_dequantize(acc, scale, relax.const(np.int32(0)))

    def realize(ctx, m):
        axes, keep = _axes(ctx.g, m.nodes)
        n = int(np.prod([shape_of(m["data"])[a] for a in axes]))
        x = ctx.activation(m["data"])
        acc = ctx.emit(qnn.sum(x.q, x.scale_c, x.zero_point_c, axis=axes, keepdims=keep))
        scale = np.float32(x.scale) / np.float32(n)
        return qnn.dequantize(acc, relax.const(np.float32(scale)), relax.const(np.int32(0)))

    return Pattern(
        name, 1, build, check, simulate, realize, weight=None, anchor="root", doc=ALLOW_LIST[op].doc
    )


PATTERNS = [register(_make(op)) for op, rule in ALLOW_LIST.items() if rule.kind == "accumulate"]
