"""Shared simulate/realize for elementwise ops of two activations with their own output qparams.

Simulated::   out = dequantize(simulated_quantize(dequantize(q_a) <op> dequantize(q_b), s_o, zp_o))
Realized::    q_out = qnn.<op>(q_a, q_b, s_a, zp_a, s_b, zp_b, s_o, zp_o)   -> int8
              out = qnn.dequantize(q_out, s_o, zp_o)   (for float consumers; int8 consumers
              of the same tensor read q_out directly)
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.registry import Pattern
from autoq.toolkit import dtype_of

_RELAX = {"add": relax.op.add, "subtract": relax.op.subtract, "multiply": relax.op.multiply}
_QNN = {"add": qnn.add, "subtract": qnn.subtract, "multiply": qnn.multiply}


def make(kind: str, doc: str = "") -> Pattern:
    def build():
        a, b = wildcard(), wildcard()
        return is_op(f"relax.{kind}")(a, b), {"lhs": a, "rhs": b}

    def check(g, nodes):
        for k in ("lhs", "rhs"):
            e = nodes[k]
            if not (
                isinstance(e, relax.Var) and g.is_data_dependent(e) and dtype_of(e) == "float32"
            ):
                return f"{k} is not a float32 activation"
        return None

    def simulate(ctx, m):
        a = ctx.activation(m["lhs"])
        b = ctx.activation(m["rhs"])
        return ctx.output(_RELAX[kind](a.real, b.real))

    def realize(ctx, m):
        a = ctx.activation(m["lhs"])
        b = ctx.activation(m["rhs"])
        out = ctx.output_qparam()
        y = _QNN[kind](
            a.q, b.q, a.scale_c, a.zero_point_c, b.scale_c, b.zero_point_c,
            out.scale_c, out.zero_point_c, out_dtype=out.dtype, rounding=ctx.rounding,
        )  # fmt: skip
        return ctx.output(y)

    return Pattern(
        kind, 1, build, check, simulate, realize, weight=None, anchor="root", doc=doc,
        int8_output=True,
    )  # fmt: skip
