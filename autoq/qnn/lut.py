"""``qnn.lut``: an 8-bit activation as a 256-entry table lookup (integer only).

``lut(data, table)[i] = table[data[i] - qmin(data.dtype)]``: ``data`` int8 or uint8, ``table``
a 1-D tensor of 256 int8 or uint8 values (the output dtype), usually a constant computed by
:func:`autoq.ir.activations.lut_table` from the input and output qparams, so sigmoid, tanh,
hardswish, gelu, silu ... run with no float arithmetic at all. The qparams are not arguments:
they are folded into the table (the slot qparams of the input and output tensors are those of
the neighbouring ``qnn`` ops).

Per channel (``axis`` given, :mod:`autoq.rules.lut_channels`): ``table`` is ``[C, 256]`` with ``C``
the size of ``data``'s dimension ``axis``, and ``lut(data, table)[i] = table[i[axis], data[i]
- qmin]``: one table per channel (each channel's input grid, or output grid, or both its own:
:mod:`autoq.rules.depthwise_channels`).
"""

from __future__ import annotations

from tvm import relax, te

from autoq.ir.activations import LUT_DTYPES
from autoq.qnn.checks import attr, check_dtype, dims, fail, static_int, tensor_type
from autoq.qnn.registration import make_call, register

__all__ = ["lut"]


def lut(data: relax.Expr, table: relax.Expr, axis: int | None = None) -> relax.Call:
    """``table[data - qmin]``: an 8-bit tensor through a 256-entry lookup table (with
    ``axis``: one ``[C, 256]`` table row per channel of that dimension)."""
    return make_call("qnn.lut", [data, table], {} if axis is None else {"axis": int(axis)})


def _infer(op, call):
    data, table = call.args
    check_dtype(op, "data", data, LUT_DTYPES)
    out = check_dtype(op, "table", table, LUT_DTYPES)
    tdims, ddims, axis = dims(table), dims(data), attr(call, "axis")
    if axis is None:
        if tdims is None or len(tdims) != 1 or static_int(tdims[0]) != 256:
            fail(op, "table", "a 1-D tensor of 256 entries", tdims)
        return tensor_type(ddims, out)
    if ddims is None or not -len(ddims) <= axis < len(ddims):
        fail(op, "axis", "a dimension of data", axis)
    channels = static_int(ddims[axis])
    if tdims is None or len(tdims) != 2 or [static_int(d) for d in tdims] != [channels, 256]:
        fail(
            op, "table", f"a [{channels}, 256] tensor (one table per channel of axis {axis})", tdims
        )
    return tensor_type(ddims, out)


def _legalize(bb, call):
    data, table = call.args
    qmin = -128 if str(data.ty.dtype) == "int8" else 0
    axis = attr(call, "axis")
    if axis is None:
        idx = relax.op.subtract(relax.op.astype(data, "int32"), relax.const(qmin, "int32"))
        return bb.normalize(relax.op.take(table, idx, axis=0, mode="clip"))
    ax = axis % len(dims(data))

    def f(d, t):  # row i[ax] of the table: no constant row offsets (BYOC kernels hold none)
        return te.compute(d.shape, lambda *i: t[i[ax], d[i].astype("int32") - qmin], name="qnn_lut")

    return bb.call_te(f, data, table, primfunc_name_hint="qnn_lut")


register(lut, _infer, _legalize)
