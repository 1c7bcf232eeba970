"""Shared simulate/realize for elementwise ops with their own output qparams: of two
activations, or of an activation and a constant (``x + c``, ``x - c``, ``x * c``; the
canonical graph has the constant second, and ``x / c`` is ``x * (1/c)`` after
:mod:`autoq.ir.canonicalize`).

Simulated::   out = dequantize(simulated_quantize(dequantize(q_a) <op> dequantize(q_b), s_o, zp_o))
Realized::    q_out = qnn.<op>(q_a, q_b, s_a, zp_a, s_b, zp_b, s_o, zp_o)   -> int8
              out = qnn.dequantize(q_out, s_o, zp_o)   (for float consumers; int8 consumers
              of the same tensor read q_out directly)

A constant operand ``b`` is the layer's weight (slot ``<layer>.weight``): quantized once,
**per tensor** (the qnn elementwise ops take per-tensor qparams) with the weight spec's
dtype and range, and stored as an int8 constant with its own scale and zero point.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.ir.registry import Pattern
from autoq.ir.toolkit import dtype_of, shape_of

_RELAX = {"add": relax.op.add, "subtract": relax.op.subtract, "multiply": relax.op.multiply}
_QNN = {"add": qnn.add, "subtract": qnn.subtract, "multiply": qnn.multiply}


def _is_activation(g, e) -> bool:
    return isinstance(e, relax.Var) and g.is_data_dependent(e) and dtype_of(e) == "float32"


def _check_constant(g, nodes) -> str | None:
    ref = g.weight_of(nodes["rhs"])
    if ref is None or ref.array.dtype != np.float32:
        return "rhs is not a constant float32 tensor"
    if shape_of(nodes["root"]) != shape_of(nodes["lhs"]):
        return "the constant broadcasts the activation to a larger shape"
    return None


def make(kind: str, doc: str = "", constant: bool = False) -> Pattern:
    """The pattern ``kind`` (two activations) or ``<kind>_const`` (``constant``: the
    second operand a constant)."""

    def build():
        a, b = wildcard(), wildcard()
        return is_op(f"relax.{kind}")(a, b), {"lhs": a, "rhs": b}

    def check(g, nodes):
        for k in ("lhs",) if constant else ("lhs", "rhs"):
            if not _is_activation(g, nodes[k]):
                return f"{k} is not a float32 activation"
        return _check_constant(g, nodes) if constant else None

    def operands(ctx, m):
        a = ctx.activation(m["lhs"])
        b = ctx.weight(m["rhs"], None) if constant else ctx.activation(m["rhs"])
        return a, b

    def simulate(ctx, m):
        a, b = operands(ctx, m)
        return ctx.output(_RELAX[kind](a.real, b.real))

    def realize(ctx, m):
        a, b = operands(ctx, m)
        out = ctx.output_qparam()
        # per-channel qparams (autoq.rules.residual_channels): all on one axis, the op gets it
        axes = {q.qparam.axis for q in (a, b, out) if q.qparam.axis is not None}
        y = _QNN[kind](
            a.q, b.q, a.scale_c, a.zero_point_c, b.scale_c, b.zero_point_c,
            out.scale_c, out.zero_point_c, out_dtype=out.dtype, rounding=ctx.rounding,
            axis=axes.pop() if axes else None,
        )  # fmt: skip
        return ctx.output(y)

    return Pattern(
        f"{kind}_const" if constant else kind, 1, build, check, simulate, realize,
        weight="rhs" if constant else None, anchor="root", doc=doc, int8_output=True,
    )  # fmt: skip
