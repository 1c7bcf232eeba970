"""Activation + per-tensor affine patterns (``<activation>_affine``, e.g. PP-OCRv4's
``hardswish(x) * a + b``, its learnable affine block): ``add(multiply(f(x), a), b)`` with
``a`` and ``b`` one-element constants, as ONE 8-bit table lookup.

Without it the chain is three layers and three roundings onto an int8 grid (the
activation's table, then ``multiply_const`` and ``add_const``, each requantizing to its
own calibrated scale); the table of ``g(x) = f(x) * a + b`` maps the input integers to the
output integers with one rounding, exactly like the plain activation pattern
(``patterns/activation.py``: same simulated / realized forms, the table computed by
:func:`autoq.ir.activations.lut_table` from :func:`autoq.ir.activations.affine`). A layer with a
16-bit input or output slot computes ``g`` in float between ``qnn.dequantize`` and
``qnn.quantize``. Priority 3 (three ops), so it claims the chain before the one-op patterns;
the intermediate values must have no other reader (the matcher's rule).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.ir.activations import ACTIVATIONS, LUT_DTYPES, affine
from autoq.ir.registry import Pattern, register
from autoq.ir.toolkit import const, shape_of
from autoq.rules import lut_channels

from ._accumulate import is_activation


def _scalar(g, e) -> float | None:
    ref = g.weight_of(e)
    if ref is None or ref.array.dtype != np.float32 or ref.array.size != 1:
        return None
    return float(ref.array.reshape(()))


def _row(g, m):
    """The affine activation row of match ``m``."""
    return affine(m.pattern.name.removesuffix("_affine"), _scalar(g, m["a"]), _scalar(g, m["b"]))


def _make(op: str, name: str) -> Pattern:
    def build():
        x, a, b = wildcard(), wildcard(), wildcard()
        act = is_op(op)(x)
        mul = is_op("relax.multiply")(act, a)
        return is_op("relax.add")(mul, b), {"data": x, "act": act, "mul": mul, "a": a, "b": b}

    def check(g, nodes):
        if not is_activation(g, nodes["data"]):
            return "input is not a float32 activation"
        if _scalar(g, nodes["a"]) is None or _scalar(g, nodes["b"]) is None:
            return "the multiplier and the addend are not one-element float32 constants"
        if shape_of(nodes["root"]) != shape_of(nodes["data"]):
            return "the constants broadcast the activation to a larger shape"
        return None

    def float_value(ctx, m, x):
        f = relax.Call(ctx.g.value[m["act"]].op, [x])
        a, b = _scalar(ctx.g, m["a"]), _scalar(ctx.g, m["b"])
        return relax.op.add(relax.op.multiply(f, const(a, "float32")), const(b, "float32"))

    def simulate(ctx, m):
        x = ctx.activation(m["data"])
        return ctx.lut_output(x, float_value(ctx, m, x.real), _row(ctx.g, m))

    def realize(ctx, m):
        x = ctx.activation(m["data"])
        out = ctx.output_qparam()
        if x.dtype in LUT_DTYPES and out.dtype in LUT_DTYPES:
            t = lut_channels.table(_row(ctx.g, m), x.qparam, out.qparam)
            axis = lut_channels.lut_axis(x.qparam, out.qparam)
            return ctx.output(qnn.lut(x.q, const(t), axis))
        y = float_value(ctx, m, x.real)
        return ctx.output(
            qnn.quantize(y, out.scale_c, out.zero_point_c, axis=out.axis, out_dtype=out.dtype)
        )

    return Pattern(
        f"{name}_affine", 3, build, check, simulate, realize, weight=None, anchor="act",
        doc=f"{name}(x) * a + b (one-element a, b) as one 8-bit table lookup", int8_output=True,
    )  # fmt: skip


PATTERNS = [register(_make(op, act.name)) for op, act in ACTIVATIONS.items()]
