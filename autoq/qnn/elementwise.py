"""``qnn.add``, ``qnn.subtract`` and ``qnn.multiply``: elementwise ops with their own output
scale and zero point (per-tensor), in float32 or integer-only (see
:func:`autoq.primitives.elementwise`)."""

from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx

from autoq import primitives as P
from autoq.qnn import tflite_arith as TA
from autoq.qnn.checks import (
    QDTYPES,
    QnnError,
    attr,
    broadcast_dims,
    check_dtype,
    check_out_dtype,
    check_qparams,
    check_rounding,
    check_scalar,
    dims,
    static_int,
    tensor_type,
    type_of,
)
from autoq.qnn.quantize import constant_scales
from autoq.qnn.registration import make_call, register
from autoq.qnn.tensor_exprs import (
    call_te,
    clip_int64,
    dequantize_value,
    fixed_point_multiply,
    param_at,
    quantize_value,
    rshift_round,
)

__all__ = ["add", "channel_multipliers", "multiply", "subtract"]

_OPERANDS = (
    ("lhs_scale", "lhs_zero_point"),
    ("rhs_scale", "rhs_zero_point"),
    ("output_scale", "output_zero_point"),
)
_FLOAT_FN = {
    "add": lambda x, y: x + y,
    "subtract": lambda x, y: x - y,
    "multiply": lambda x, y: x * y,
}


def _builder(name):
    def build(
        lhs: relax.Expr,
        rhs: relax.Expr,
        lhs_scale: relax.Expr,
        lhs_zero_point: relax.Expr,
        rhs_scale: relax.Expr,
        rhs_zero_point: relax.Expr,
        output_scale: relax.Expr,
        output_zero_point: relax.Expr,
        out_dtype: str = "int8",
        rounding: str = "float",
        axis: int | None = None,
    ) -> relax.Call:
        qparams = [lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point]
        attrs = {"out_dtype": out_dtype, "rounding": rounding}
        if axis is not None:  # per-channel qparams along the output's ``axis``
            attrs["axis"] = int(axis)
        return make_call(
            "qnn." + name, [lhs, rhs, *qparams, output_scale, output_zero_point], attrs
        )

    build.__name__ = name
    build.__doc__ = (
        f"Quantized {name}: ``quantize(dequantize(lhs) {name} dequantize(rhs))`` with the output "
        "scale/zero point (per-tensor; with ``axis``, any of the three qparam pairs may be "
        "per channel along the output's axis ``axis``, operands of the output's shape); "
        "integer-only for rounding != 'float' (see primitives.elementwise)."
    )
    return build


add = _builder("add")
subtract = _builder("subtract")
multiply = _builder("multiply")


def _infer_elementwise(op, call):
    a, b, s_a, z_a, s_b, z_b, s_o, z_o = call.args
    adt = check_dtype(op, "lhs", a, ["int8", "uint8", "int16"])
    bdt = check_dtype(op, "rhs", b, ["int8", "uint8", "int16"])
    out_dtype = attr(call, "out_dtype")
    check_out_dtype(op, out_dtype, QDTYPES)
    check_rounding(op, attr(call, "rounding"))
    pairs = ((s_a, z_a), (s_b, z_b), (s_o, z_o))
    out = broadcast_dims(op, dims(a), dims(b))
    axis = attr(call, "axis")
    if axis is not None and out is not None:
        if not -len(out) <= axis < len(out):
            raise QnnError(f"{op}: axis {axis} is out of range for a rank-{len(out)} output")
        if dims(a) != out or dims(b) != out:
            raise QnnError(f"{op}: per-channel qparams (axis) need operands of the output's shape")
    for names, (s, z), dt in zip(_OPERANDS, pairs, (adt, bdt, out_dtype), strict=True):
        if axis is None:
            check_qparams(op, s, z, dt, None, None, names)
            check_scalar(op, names[0], s, "elementwise qnn ops are per-tensor without axis")
        else:
            check_qparams(op, s, z, dt, out, axis, names)
    return tensor_type(out, out_dtype)


def _broadcast_index(t, i, ndim):
    """numpy broadcasting: ``t``'s element for output index ``i`` (of rank ``ndim``)."""
    r = len(t.shape)
    out = []
    for k in range(r):
        j = i[ndim - r + k]
        out.append(0 if static_int(t.shape[k]) == 1 else j)
    return t[tuple(out)]


def _legalize_float(bb, call, out_shape, qmin, qmax):
    op, out_dtype = call.op.name, attr(call, "out_dtype")
    fn = _FLOAT_FN[op.split(".")[1]]
    ndim = len(out_shape)
    ax = attr(call, "axis", 0)  # (per-tensor qparams: any axis reads their one value)

    def f(a, b, sa, za, sb, zb, so, zo):
        def g(*i):
            ra = dequantize_value(
                _broadcast_index(a, i, ndim), param_at(sa, i, ax), param_at(za, i, ax)
            )
            rb = dequantize_value(
                _broadcast_index(b, i, ndim), param_at(sb, i, ax), param_at(zb, i, ax)
            )
            v = quantize_value(fn(ra, rb), param_at(so, i, ax), param_at(zo, i, ax), qmin, qmax)
            return v.astype(out_dtype)

        return te.compute(out_shape, g, name=op.replace(".", "_"))

    # the operands stay tensors (a 0-d constant operand, x * c, is not an immediate)
    return call_te(bb, f, list(call.args[:2]), list(call.args[2:]), op.replace(".", "_"))


def _legalize_integer(bb, call, out_shape, qmin, qmax):
    op, out_dtype, rounding = call.op.name, attr(call, "out_dtype"), attr(call, "rounding")
    a, b, s_a, z_a, s_b, z_b, s_o, z_o = call.args
    scales = constant_scales(
        op,
        {"lhs_scale": s_a, "rhs_scale": s_b, "output_scale": s_o},
        "use rounding='float' for runtime scales",
    )
    kind = op.split(".")[1]
    ndim = len(out_shape)

    def int64(v):
        return tirx.const(int(v), "int64")

    if attr(call, "axis") is not None:
        return _legalize_channels(bb, call, out_shape, qmin, qmax, scales)
    if rounding == "tflite":
        return _legalize_tflite(bb, call, out_shape, qmin, qmax, scales)
    # tflite_single: one rounding of the exact result, ties up (TFLite's three-rounding
    # kernel built with single rounding is autoq.qnn.tflite_arith.elementwise; its two-stage
    # legalization disagreed with it on subtract ties: not used)
    mode = "half_up" if rounding == "tflite_single" else rounding
    ma, mb, shift = P.elementwise_multipliers(kind, *scales)

    def f(a, b, za, zb, zo):
        def g(*i):
            da = _broadcast_index(a, i, ndim).astype("int64") - param_at(za, i, 0).astype("int64")
            db = _broadcast_index(b, i, ndim).astype("int64") - param_at(zb, i, 0).astype("int64")
            acc = P.elementwise_accumulator(kind, da, db, ma, mb, const=int64)
            y = rshift_round(acc, int64(shift), mode) + param_at(zo, i, 0).astype("int64")
            return clip_int64(y, qmin, qmax, out_dtype)

        return te.compute(out_shape, g, name=op.replace(".", "_"))

    return call_te(bb, f, [a, b], [z_a, z_b, z_o], op.replace(".", "_"))


def channel_multipliers(kind: str, scales, channels: int):
    """Per channel ``(ma, mb, shift)`` int64 arrays of length ``channels``: each channel's
    :func:`autoq.primitives.elementwise_multipliers` (a per-tensor scale repeats)."""
    sa, sb, so = (np.broadcast_to(np.asarray(v, np.float32).reshape(-1), channels) for v in scales)
    rows = [P.elementwise_multipliers(kind, *c) for c in zip(sa, sb, so, strict=True)]
    return tuple(np.array(col, np.int64) for col in zip(*rows, strict=True))


def _legalize_channels(bb, call, out_shape, qmin, qmax, scales):
    """Integer-only elementwise op with per-channel qparams along ``axis``: channel ``c``
    computes exactly what the per-tensor op computes with channel ``c``'s scales and zero
    points (its own multipliers and shift)."""
    op, out_dtype, rounding = call.op.name, attr(call, "out_dtype"), attr(call, "rounding")
    if rounding in ("tflite", "tflite_single"):
        raise QnnError(
            f"{op}: per-channel qparams (axis) need rounding float, half_even, half_away or half_up"
        )
    a, b, _, z_a, _, z_b, _, z_o = call.args
    kind, ndim = op.split(".")[1], len(out_shape)
    ax = attr(call, "axis") % ndim
    consts = [relax.const(v) for v in channel_multipliers(kind, scales, static_int(out_shape[ax]))]

    def f(a, b, za, zb, zo, ma, mb, sh):
        def g(*i):
            c = i[ax]
            da = a[i].astype("int64") - param_at(za, i, ax).astype("int64")
            db = b[i].astype("int64") - param_at(zb, i, ax).astype("int64")
            acc = P.elementwise_accumulator(kind, da, db, ma[c], mb[c], const=lambda v: v)
            y = rshift_round(acc, sh[c], rounding) + param_at(zo, i, ax).astype("int64")
            return clip_int64(y, qmin, qmax, out_dtype)

        return te.compute(out_shape, g, name=op.replace(".", "_"))

    return call_te(bb, f, [a, b], [z_a, z_b, z_o, *consts], op.replace(".", "_"))


def _legalize_tflite(bb, call, out_shape, qmin, qmax, scales):
    """TFLite's ADD/SUB/MUL kernels (:mod:`autoq.qnn.tflite_arith`) in two stages: the raw
    rescaled sum (or product), then its output rescale (one stage would nest the three
    fixed-point multiplies into one expression, slow to compile)."""
    op, out_dtype, rounding = call.op.name, attr(call, "out_dtype"), attr(call, "rounding")
    a, b, _, z_a, _, z_b, _, z_o = call.args
    kind, ndim = op.split(".")[1], len(out_shape)
    shift = TA.left_shift([type_of(a).dtype, type_of(b).dtype])
    mults = TA.elementwise_multipliers(kind, *scales, shift=shift)

    def multiply(x, m, s):
        return fixed_point_multiply(x, tirx.const(m, "int64"), tirx.const(s, "int64"), rounding)

    def f(a, b, za, zb, zo):
        def raw(*i):
            da = _broadcast_index(a, i, ndim).astype("int64") - param_at(za, i, 0).astype("int64")
            db = _broadcast_index(b, i, ndim).astype("int64") - param_at(zb, i, 0).astype("int64")
            return TA.elementwise_operands(kind, da, db, mults, multiply, shift)

        r = te.compute(out_shape, raw, name="tflite_operands")

        def g(*i):
            y = TA.elementwise_output(kind, r[i], mults, multiply)
            return clip_int64(y + param_at(zo, i, 0).astype("int64"), qmin, qmax, out_dtype)

        return te.compute(out_shape, g, name=op.replace(".", "_"))

    return call_te(bb, f, [a, b], [z_a, z_b, z_o], op.replace(".", "_"))


def _legalize_elementwise(bb, call):
    qmin, qmax = P.qrange(attr(call, "out_dtype"))
    shape = type_of(call).shape
    if shape is None:
        raise QnnError(f"{call.op.name}: legalization needs a known output rank")
    out_shape = list(shape.values)
    if attr(call, "rounding") == "float":
        return _legalize_float(bb, call, out_shape, qmin, qmax)
    return _legalize_integer(bb, call, out_shape, qmin, qmax)


for _builder_fn in (add, subtract, multiply):
    register(_builder_fn, _infer_elementwise, _legalize_elementwise)
