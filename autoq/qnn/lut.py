"""``qnn.lut``: an 8-bit activation as a 256-entry table lookup (integer only).

``lut(data, table)[i] = table[data[i] - qmin(data.dtype)]``: ``data`` int8 or uint8, ``table``
a 1-D tensor of 256 int8 or uint8 values (the output dtype), usually a constant computed by
:func:`autoq.activations.lut_table` from the input and output qparams, so sigmoid, tanh,
hardswish, gelu, silu ... run with no float arithmetic at all. The qparams are not arguments:
they are folded into the table (the slot qparams of the input and output tensors are those of
the neighbouring ``qnn`` ops).
"""

from __future__ import annotations

from tvm import relax

from ..activations import LUT_DTYPES
from .checks import check_dtype, dims, fail, static_int, tensor_type
from .registration import make_call, register

__all__ = ["lut"]


def lut(data: relax.Expr, table: relax.Expr) -> relax.Call:
    """``table[data - qmin]``: an 8-bit tensor through a 256-entry lookup table."""
    return make_call("qnn.lut", [data, table], {})


def _infer(op, call):
    data, table = call.args
    check_dtype(op, "data", data, LUT_DTYPES)
    out = check_dtype(op, "table", table, LUT_DTYPES)
    tdims = dims(table)
    if tdims is None or len(tdims) != 1 or static_int(tdims[0]) != 256:
        fail(op, "table", "a 1-D tensor of 256 entries", tdims)
    return tensor_type(dims(data), out)


def _legalize(bb, call):
    data, table = call.args
    qmin = -128 if str(data.ty.dtype) == "int8" else 0
    idx = relax.op.subtract(relax.op.astype(data, "int32"), relax.const(qmin, "int32"))
    return bb.normalize(relax.op.take(table, idx, axis=0, mode="clip"))


register(lut, _infer, _legalize)
