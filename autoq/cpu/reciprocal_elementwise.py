"""Float requantizes of 8-bit codes outside the kernels, dividing by a reciprocal product.

A ``qnn.add`` / ``qnn.subtract`` of two 8-bit tensors and a ``qnn.requantize`` of one (float
rounding, constant per-tensor qparams, 8-bit output: the adds of ResNet-50's projection
blocks and the requantize after them) divide by the output scale once per element, the
slowest instruction of their fused loop. On the targets whose kernels divide by a
reciprocal (:attr:`autoq.cpu.isa.Isa.reciprocal`) they lower to the legalization's TE
expression with ``x / s`` as ``x * RN(1 / s)`` plus FMA corrections, as many as give the
quotient of every value ``x`` takes: with 8-bit inputs that is a finite set (65536 code
pairs, 256 codes), each checked when the op is lowered
(:func:`autoq.primitives.division_steps_on`); where two corrections are not enough the op
keeps its own legalization. The round / zero point / clip tail is
:func:`autoq.cpu.epilogue.round_clip` (the same values). Bit for bit the legalization's
results, and still fused with their neighbours.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from autoq import primitives as P
from autoq.cpu.epilogue import round_clip
from autoq.ir.toolkit import const_array, dtype_of, shape_of
from autoq.qnn.tensor_exprs import dequantize_value, divide_by_reciprocal

__all__ = ["reciprocal_elementwise", "reciprocal_requantize"]

_CODES = ("int8", "uint8")
# the float legalization's operation on the two dequantized operands
_OPS = {"qnn.add": np.add, "qnn.subtract": np.subtract}


def _scalars(args) -> list | None:
    """The constant per-tensor values of ``args``, or None."""
    values = [const_array(a) for a in args]
    if any(v is None or v.size != 1 for v in values):
        return None
    return [v.reshape(-1)[0] for v in values]


def _quantized(x, s_out, z_out, steps: int, out_dtype: str):
    """``clip(round(x / s_out) + z_out)`` as ``out_dtype``, dividing by the reciprocal."""
    s = tirx.const(float(np.float32(s_out)), "float32")
    r = tirx.const(float(np.float32(1) / np.float32(s_out)), "float32")
    qmin, qmax = P.qrange(out_dtype)
    u = divide_by_reciprocal(x, s, r, steps)
    return round_clip(u, tirx.const(int(z_out), "int32"), qmin, qmax, out_dtype)


def _dequantized(q, s, z):
    return dequantize_value(q, tirx.const(float(np.float32(s)), "float32"), tirx.const(int(z)))


def _plain(call, inputs) -> tuple | None:
    """(output dtype, qparams) of a float-rounding call on 8-bit ``inputs`` of its own shape
    with constant per-tensor qparams (then its axis reads their one value) and an 8-bit
    output, or None."""
    a = call.attrs
    out_dtype = str(a["out_dtype"])
    if str(a["rounding"]) != "float" or out_dtype not in _CODES:
        return None
    shape = shape_of(call)
    if shape is None or any(dtype_of(x) not in _CODES or shape_of(x) != shape for x in inputs):
        return None
    qparams = _scalars(call.args[len(inputs) :])
    return None if qparams is None else (out_dtype, qparams)


def reciprocal_elementwise(bb, call):
    """``qnn.add`` / ``qnn.subtract`` of two 8-bit tensors of the output's shape (see the
    module doc) as a TE call dividing by a reciprocal, or None."""
    op = call.op.name
    a, b = call.args[:2]
    plain = _plain(call, (a, b)) if op in _OPS else None
    if plain is None:
        return None
    out_dtype, (sa, za, sb, zb, so, zo) = plain
    ra = P.dequantize(P.all_codes(dtype_of(a)), sa, za)
    rb = P.dequantize(P.all_codes(dtype_of(b)), sb, zb)
    steps = P.division_steps_on(np.unique(_OPS[op](ra[:, None], rb[None, :])), so)
    if not steps:
        return None
    name = op.replace(".", "_")

    def f(ta, tb):
        def g(*i):
            x = _dequantized(ta[i], sa, za)
            y = _dequantized(tb[i], sb, zb)
            return _quantized(x + y if op == "qnn.add" else x - y, so, zo, steps, out_dtype)

        return te.compute(ta.shape, g, name=name)

    return bb.call_te(f, a, b, primfunc_name_hint=name)


def reciprocal_requantize(bb, call):
    """``qnn.requantize`` of an 8-bit tensor to 8 bits (see the module doc) as a TE call
    dividing by a reciprocal, or None."""
    x = call.args[0]
    plain = _plain(call, (x,)) if len(call.args) == 5 else None
    if plain is None:
        return None
    out_dtype, (si, zi, so, zo) = plain
    steps = P.division_steps_on(P.dequantize(P.all_codes(dtype_of(x)), si, zi), so)
    if not steps:
        return None

    def f(tx):
        def g(*i):
            return _quantized(_dequantized(tx[i], si, zi), so, zo, steps, out_dtype)

        return te.compute(tx.shape, g, name="requantize")

    return bb.call_te(f, x, primfunc_name_hint="qnn_requantize")
