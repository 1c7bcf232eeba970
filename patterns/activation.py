"""Activation patterns (sigmoid, tanh, hardswish, hardsigmoid, silu, gelu, gelu_tanh): one
per row of :data:`autoq.ir.activations.ACTIVATIONS`, each an 8-bit table lookup.

Simulated::  out integers = table[q_x - qmin] (``<layer>.table``, a runtime input computed from
             the input and output slots' qparams; the output slot observes f(dequantize(q_x)))
Realized::   q_out = qnn.lut(q_x, table constant)     (the same table, computed in numpy)

A layer whose input or output slot is not 8-bit (an int16 override) computes the activation
in float between ``qnn.dequantize`` and ``qnn.quantize`` instead (a 65536-entry table is not
worth its memory; documented in docs/ops.md).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.ir.activations import ACTIVATIONS, LUT_DTYPES, Activation
from autoq.ir.registry import Pattern, register
from autoq.ir.toolkit import const
from autoq.rules import lut_channels

from ._accumulate import is_activation


def _make(op: str, act: Activation) -> Pattern:
    def build():
        x = wildcard()
        return is_op(op)(x), {"data": x}

    def check(g, nodes):
        if not is_activation(g, nodes["data"]):
            return "input is not a float32 activation"
        return None

    def simulate(ctx, m):
        x = ctx.activation(m["data"])
        call = ctx.g.value[m.root]
        return ctx.lut_output(x, relax.Call(call.op, [x.real], call.attrs), act.name)

    def realize(ctx, m):
        x = ctx.activation(m["data"])
        out = ctx.output_qparam()
        if x.dtype in LUT_DTYPES and out.dtype in LUT_DTYPES:
            t = lut_channels.table(act, x.qparam, out.qparam)
            axis = lut_channels.lut_axis(x.qparam, out.qparam)
            return ctx.output(qnn.lut(x.q, const(t), axis))
        call = ctx.g.value[m.root]
        y = relax.Call(call.op, [x.real], call.attrs)
        return ctx.output(
            qnn.quantize(y, out.scale_c, out.zero_point_c, axis=out.axis, out_dtype=out.dtype)
        )

    return Pattern(
        act.name, 1, build, check, simulate, realize, weight=None, anchor="root",
        doc=f"{act.doc} as an 8-bit table lookup", int8_output=True,
    )  # fmt: skip


PATTERNS = [register(_make(op, act)) for op, act in ACTIVATIONS.items()]
