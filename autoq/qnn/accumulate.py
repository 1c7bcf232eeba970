"""The accumulating ops: ``qnn.conv2d``, ``qnn.dense``, ``qnn.matmul`` and ``qnn.sum``.

They return int32 with scale ``input_scale * weight_scale`` (per output channel) and zero
point 0. With 8-bit operands and constant zero points the legalizations run on the 8-bit
values and correct for the zero points afterwards (int32 accumulator); otherwise the
operands are widened to int32 and centered first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tvm import relax

from autoq.ir.toolkit import const, const_array
from autoq.qnn.checks import (
    ACC_DTYPE,
    ACC_INPUT_DTYPES,
    attr,
    broadcast_dims,
    check_dtype,
    check_qparams,
    check_scalar,
    dims,
    fail,
    static_int,
    tensor_type,
    type_of,
)
from autoq.qnn.registration import make_call, register

__all__ = ["conv2d", "dense", "depthwise_shape", "matmul", "sum"]

_INPUT = ("input_scale", "input_zero_point")
INT32_MAX = 2**31 - 1
_WEIGHT = ("weight_scale", "weight_zero_point")


def _centered(x, zp, dtype="int32"):
    """Relax expression ``int32(x) - zp`` (the zero-point-free integer operand)."""
    xi = relax.op.astype(x, dtype)
    z = const_array(zp)
    if z is not None and np.all(z == 0):
        return xi
    if dtype != "int32":  # zero points are int32
        zp = relax.op.astype(zp, dtype)
    return relax.op.subtract(xi, zp)


def _scalar_zp(zp) -> int | None:
    """The zero point as a Python int when it is a constant with one value, else None."""
    z = const_array(zp)
    if z is None or (z.size > 1 and not np.all(z == z.reshape(-1)[0])):
        return None
    return int(z.reshape(-1)[0])


def _max_code(x, zp) -> int:
    """Largest ``|x - zp|`` ``x``'s dtype allows (``zp`` constant; else the dtype's width)."""
    info = np.iinfo(str(type_of(x).dtype))
    z = const_array(zp)
    if z is None:
        return int(info.max) - int(info.min)
    z = z.astype(np.int64)
    return int(max(info.max - z.min(), z.max() - info.min))


def _fits_int32(data, z_x, weight, z_w, k: int | None) -> bool:
    """Whether ``sum_k (x - zx)(w - zw)`` stays within int32 for *every* input: the largest
    centered input code times the largest row sum of ``|w - zw|`` (a constant weight) or
    ``K`` times the largest weight code. 8-bit operands fit up to K = 33025 (255**2 * K);
    int16 ones need int64 much sooner (65535 * 127 * 1536 = 1.3e10 for an int16 x int8
    dense of K=1536)."""
    w, zw = const_array(weight), const_array(z_w)
    if w is not None and zw is not None and w.ndim >= 2:
        rows = w.astype(np.int64).reshape(w.shape[0], -1)
        rows = rows - zw.astype(np.int64).reshape(-1, 1)
        wsum = int(np.abs(rows).sum(axis=1).max())
    elif k is not None:
        wsum = _max_code(weight, z_w) * k
    else:
        return False
    return _max_code(data, z_x) * wsum <= INT32_MAX


def _saturating(accumulate, fits: bool):
    """``accumulate(dtype)`` in int32 when the bound allows, else in int64 saturated to
    int32 (an accumulator beyond int32 is far outside any requantized output range: clipping
    it gives the same output, wrapping would not)."""
    if fits:
        return accumulate(ACC_DTYPE)
    acc = accumulate("int64")
    lo, hi = const(-INT32_MAX - 1, "int64"), const(INT32_MAX, "int64")
    return relax.op.astype(relax.op.minimum(relax.op.maximum(acc, lo), hi), ACC_DTYPE)


def _int8_direct(data, weight, z_w) -> bool:
    """The fast lowering applies: 8-bit operands and an all-zero constant weight zero point
    (symmetric weights, the default): the op runs on the int8 values themselves."""
    return (
        str(type_of(data).dtype) in ("int8", "uint8")
        and str(type_of(weight).dtype) in ("int8", "uint8")
        and _scalar_zp(z_w) == 0
    )


def _zp_correction(bb, weight, zx: int, axes, shape):
    """``zx * sum(weight, axes)`` reshaped to broadcast over the accumulator (int32); folded
    to a constant when the weight is one."""
    w = const_array(weight)
    if w is not None:
        return relax.const(
            (zx * w.astype(np.int64).sum(axis=tuple(axes))).astype(np.int32).reshape(shape)
        )
    wsum = bb.emit(relax.op.sum(relax.op.astype(weight, "int32"), axis=list(axes)))
    return relax.op.reshape(bb.emit(relax.op.multiply(wsum, relax.const(np.int32(zx)))), shape)


def _weighted(name: str, data, weight, qparams: Sequence, attrs: dict) -> relax.Call:
    """A call of an accumulating op of two operands, each followed by its scale and zero point."""
    return make_call(name, [data, weight, *qparams], {**attrs, "out_dtype": ACC_DTYPE})


# ------------------------------------------------------------------------------- conv2d


def conv2d(
    data: relax.Expr,
    weight: relax.Expr,
    input_scale: relax.Expr,
    input_zero_point: relax.Expr,
    weight_scale: relax.Expr,
    weight_zero_point: relax.Expr,
    strides=(1, 1),
    padding=(0, 0, 0, 0),
    dilation=(1, 1),
    groups: int = 1,
    data_layout: str = "NCHW",
    kernel_layout: str = "OIHW",
) -> relax.Call:
    """int32 ``conv2d(data - input_zero_point, weight - weight_zero_point)``.

    Padding pads the *real* value 0, i.e. the integer ``input_zero_point``. The result has
    scale ``input_scale * weight_scale`` (per output channel) and zero point 0.
    """
    padding = list(padding)
    if len(padding) == 2:
        padding = padding * 2
    qparams = [input_scale, input_zero_point, weight_scale, weight_zero_point]
    attrs = {
        "strides": list(strides),
        "padding": padding,
        "dilation": list(dilation),
        "groups": int(groups),
        "data_layout": data_layout,
        "kernel_layout": kernel_layout,
    }
    return _weighted("qnn.conv2d", data, weight, qparams, attrs)


def _infer_conv2d(op, call):
    data, weight, s_x, z_x, s_w, z_w = call.args
    xdt = check_dtype(op, "data", data, ACC_INPUT_DTYPES)
    wdt = check_dtype(op, "weight", weight, ACC_INPUT_DTYPES)
    layouts = (attr(call, "data_layout"), attr(call, "kernel_layout"))
    if layouts != ("NCHW", "OIHW"):
        fail(op, "data_layout/kernel_layout", "NCHW/OIHW", layouts)
    xd, wd = dims(data), dims(weight)
    if xd is not None and len(xd) != 4:
        fail(op, "data", "a 4-D NCHW tensor", f"{len(xd)}-D")
    if wd is not None and len(wd) != 4:
        fail(op, "weight", "a 4-D OIHW tensor", f"{len(wd)}-D")
    groups = attr(call, "groups")
    check_qparams(op, s_w, z_w, wdt, wd, 0, _WEIGHT)
    if _depthwise(xd, wd, groups):  # per-channel input (autoq.rules.depthwise_channels)
        check_qparams(op, s_x, z_x, xdt, xd, 1, _INPUT)
    else:
        check_qparams(op, s_x, z_x, xdt, None, None, _INPUT)
        for name, e in zip(_INPUT, (s_x, z_x), strict=True):
            check_scalar(
                op, name, e, "activations are quantized per tensor except a depthwise input"
            )
    if xd is None or wd is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=4)
    cin, ci_w = static_int(xd[1]), static_int(wd[1])
    if cin is not None and ci_w is not None and cin != ci_w * groups:
        fail(op, "weight", f"of shape [O, {cin}/groups={cin // max(groups, 1)}, kH, kW]", wd)
    st, pad, dil = attr(call, "strides"), attr(call, "padding"), attr(call, "dilation")
    oh = (xd[2] + pad[0] + pad[2] - dil[0] * (wd[2] - 1) - 1) // st[0] + 1
    ow = (xd[3] + pad[1] + pad[3] - dil[1] * (wd[3] - 1) - 1) // st[1] + 1
    return relax.TensorType([xd[0], wd[0], oh, ow], ACC_DTYPE)


def depthwise_shape(channels, weight_shape, groups) -> bool:
    """Whether a conv of ``channels`` input channels, an OIHW ``weight_shape`` and
    ``groups`` is depthwise with channel multiplier 1 (``groups`` == input channels ==
    output channels, weight ``[C, 1, KH, KW]``): its input qparams may be per channel.

    >>> depthwise_shape(8, (8, 1, 3, 3), 8), depthwise_shape(8, (16, 1, 3, 3), 8)
    (True, False)
    """
    return (
        channels is not None
        and len(weight_shape) == 4
        and groups == channels == weight_shape[0]
        and weight_shape[1] == 1
    )


def _depthwise(xd, wd, groups) -> bool:
    """A depthwise conv of static shapes (:func:`depthwise_shape`)."""
    if xd is None or wd is None or len(xd) != 4:
        return False
    return depthwise_shape(static_int(xd[1]), [static_int(d) for d in wd], groups)


def _relax_conv2d(call, x, w, padding, out_dtype=ACC_DTYPE):
    """``relax.op.nn.conv2d`` with the qnn call's attributes, int32 (or ``out_dtype``) out."""
    return relax.op.nn.conv2d(
        x,
        w,
        strides=attr(call, "strides"),
        padding=padding,
        dilation=attr(call, "dilation"),
        groups=attr(call, "groups"),
        out_dtype=out_dtype,
    )


def _static_product(ds) -> int | None:
    vals = [static_int(d) for d in ds]
    return None if any(v is None for v in vals) else int(np.prod(vals))


def _legalize_conv2d(bb, call):
    data, weight, _s_x, z_x, _s_w, z_w = call.args
    zx = _scalar_zp(z_x)
    if zx is None or not _int8_direct(data, weight, z_w):
        # (per-channel input zero points of a depthwise conv: x - zx[c], padded with 0)
        zw = relax.op.reshape(z_w, [-1, 1, 1, 1]) if type_of(z_w).ndim == 1 else z_w
        zxc = relax.op.reshape(z_x, [1, -1, 1, 1]) if type_of(z_x).ndim == 1 else z_x
        wd = dims(weight)
        k = None if wd is None else _static_product(wd[1:])

        def accumulate(dt):
            x, w = _centered(data, zxc, dt), _centered(weight, zw, dt)
            return _relax_conv2d(call, x, w, attr(call, "padding"), dt)

        return _saturating(accumulate, _fits_int32(data, z_x, weight, z_w, k))
    # conv(x - zx, w) = conv(pad_zx(x), w) - zx * sum(w): int8 operands, int32 accumulator
    # (about 2x faster than widening first). Padding must hold the zero point, so it is
    # done explicitly when zx != 0.
    pad = attr(call, "padding")
    x = data
    if zx != 0 and any(pad):
        x = relax.op.nn.pad(
            data, [0, 0, 0, 0, pad[0], pad[2], pad[1], pad[3]], "constant", float(zx)
        )
        pad = [0, 0, 0, 0]
    acc = _relax_conv2d(call, x, weight, pad)
    if zx == 0:
        return acc
    return relax.op.subtract(acc, _zp_correction(bb, weight, zx, (1, 2, 3), [1, -1, 1, 1]))


register(conv2d, _infer_conv2d, _legalize_conv2d)


# -------------------------------------------------------------------------------- dense


def dense(
    data, weight, input_scale, input_zero_point, weight_scale, weight_zero_point
) -> relax.Call:
    """int32 ``(data - input_zp) @ (weight - weight_zp).T``; ``weight`` is ``[N, K]``.

    The weight's per-channel parameters index N (its axis 0). Scale of the result:
    ``input_scale * weight_scale`` along the last axis.
    """
    qparams = [input_scale, input_zero_point, weight_scale, weight_zero_point]
    return _weighted("qnn.dense", data, weight, qparams, {})


def _infer_dense(op, call):
    data, weight, s_x, z_x, s_w, z_w = call.args
    xdt = check_dtype(op, "data", data, ACC_INPUT_DTYPES)
    wdt = check_dtype(op, "weight", weight, ACC_INPUT_DTYPES)
    xd, wd = dims(data), dims(weight)
    if wd is not None and len(wd) != 2:
        fail(op, "weight", "a 2-D [N, K] tensor", f"{len(wd)}-D")
    if type_of(s_x).ndim >= 2 or type_of(z_x).ndim >= 2:
        _check_row_qparams(op, s_x, z_x, xd)
    else:
        check_qparams(op, s_x, z_x, xdt, None, None, _INPUT)
    check_qparams(op, s_w, z_w, wdt, wd, 0, _WEIGHT)
    if xd is None or wd is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=-1)
    k, kw = static_int(xd[-1]), static_int(wd[1])
    if k is not None and kw is not None and k != kw:
        fail(op, "weight", f"of shape [N, {k}] (K must match the data's last dimension)", wd)
    return relax.TensorType([*xd[:-1], wd[0]], ACC_DTYPE)


def _check_row_qparams(op, s_x, z_x, xd) -> None:
    """Per-row input parameters (run-time, from ``qnn.dynamic_quantize`` per token): of the
    data's shape with the last dimension 1."""
    check_dtype(op, "input_scale", s_x, ["float32"])
    check_dtype(op, "input_zero_point", z_x, ["int32"])
    if xd is None:
        return
    want = [*xd[:-1], 1]
    for name, e in zip(_INPUT, (s_x, z_x), strict=True):
        d = dims(e)
        if d is not None and [static_int(v) for v in d] != [static_int(v) for v in want]:
            fail(op, name, f"a scalar, a 1-element tensor or per row of shape {want}", d)


def _legalize_dense(bb, call):
    data, weight, _s_x, z_x, _s_w, z_w = call.args
    zx = _scalar_zp(z_x)
    if _int8_direct(data, weight, z_w) and (zx is not None or const_array(z_x) is None):
        # (x - zx) @ w.T = x @ w.T - zx * sum_k(w): 8-bit operands, int32 accumulator; a
        # run-time zx (scalar or per row) multiplies the weight's constant column sums
        acc = relax.op.matmul(data, relax.op.permute_dims(weight, [1, 0]), out_dtype=ACC_DTYPE)
        if zx == 0:
            return acc
        if zx is None:
            wsum = _zp_correction(bb, weight, 1, (1,), [-1])
            return relax.op.subtract(acc, relax.op.multiply(z_x, wsum))
        return relax.op.subtract(acc, _zp_correction(bb, weight, zx, (1,), [-1]))
    zw = relax.op.reshape(z_w, [-1, 1]) if type_of(z_w).ndim == 1 else z_w
    k = static_int(dims(weight)[1]) if dims(weight) is not None else None

    def accumulate(dt):
        w = relax.op.permute_dims(_centered(weight, zw, dt), [1, 0])
        return relax.op.matmul(_centered(data, z_x, dt), w, out_dtype=dt)

    return _saturating(accumulate, _fits_int32(data, z_x, weight, z_w, k))


register(dense, _infer_dense, _legalize_dense)


# ------------------------------------------------------------------------------- matmul


def matmul(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point) -> relax.Call:
    """int32 ``(lhs - lhs_zp) @ (rhs - rhs_zp)`` for two activations (per-tensor params)."""
    return _weighted(
        "qnn.matmul", lhs, rhs, [lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point], {}
    )


def _infer_matmul(op, call):
    a, b, s_a, z_a, s_b, z_b = call.args
    adt = check_dtype(op, "lhs", a, ACC_INPUT_DTYPES)
    bdt = check_dtype(op, "rhs", b, ACC_INPUT_DTYPES)
    check_qparams(op, s_a, z_a, adt, None, None, ("lhs_scale", "lhs_zero_point"))
    check_qparams(op, s_b, z_b, bdt, None, None, ("rhs_scale", "rhs_zero_point"))
    for name, e in (("lhs_scale", s_a), ("rhs_scale", s_b)):
        check_scalar(op, name, e, "qnn.matmul is per-tensor; use qnn.dense for weights")
    ad, bd = dims(a), dims(b)
    if ad is None or bd is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=-1)
    if len(ad) < 2 or len(bd) < 2:
        fail(op, "lhs/rhs", "tensors of rank >= 2", (ad, bd))
    k1, k2 = static_int(ad[-1]), static_int(bd[-2])
    if k1 is not None and k2 is not None and k1 != k2:
        fail(op, "rhs", f"of shape [..., {k1}, N]", bd)
    batch = broadcast_dims(op, ad[:-2], bd[:-2])
    return relax.TensorType([*batch, ad[-2], bd[-1]], ACC_DTYPE)


def _legalize_matmul(bb, call):
    a, b, _s_a, z_a, _s_b, z_b = call.args
    za, zb = _scalar_zp(z_a), _scalar_zp(z_b)
    eight_bit = all(str(type_of(t).dtype) in ("int8", "uint8") for t in (a, b))
    k = static_int(dims(a)[-1]) if dims(a) is not None else None
    if za is None or zb is None or not eight_bit or (za and zb and k is None):
        # int16 operands, per-axis or unknown zero points, unknown K: widen first (to int64
        # when int32 could overflow: see _fits_int32)
        def accumulate(dt):
            return relax.op.matmul(_centered(a, z_a, dt), _centered(b, z_b, dt), out_dtype=dt)

        fits = k is not None and _max_code(a, z_a) * _max_code(b, z_b) * k <= INT32_MAX
        return _saturating(accumulate, fits)
    # (a - za)(b - zb) = ab - zb * rowsum(a) - za * colsum(b) + K za zb, on the 8-bit values
    acc = relax.op.matmul(a, b, out_dtype=ACC_DTYPE)
    i32 = "int32"
    if zb != 0:
        rows = relax.op.sum(relax.op.astype(a, i32), axis=[-1], keepdims=True)
        acc = relax.op.subtract(acc, relax.op.multiply(rows, relax.const(np.int32(zb))))
    if za != 0:
        cols = relax.op.sum(relax.op.astype(b, i32), axis=[-2], keepdims=True)
        acc = relax.op.subtract(acc, relax.op.multiply(cols, relax.const(np.int32(za))))
    if za != 0 and zb != 0:
        acc = relax.op.add(acc, relax.const(np.int32(k * za * zb)))
    return acc


register(matmul, _infer_matmul, _legalize_matmul)


# ---------------------------------------------------------------------------------- sum


def sum(data, scale, zero_point, axis: Sequence[int], keepdims: bool = False) -> relax.Call:
    """int32 ``sum(data - zero_point, axis)``; scale stays ``scale`` (a mean divides it by N)."""
    return make_call(
        "qnn.sum",
        [data, scale, zero_point],
        {"axis": [int(a) for a in axis], "keepdims": bool(keepdims), "out_dtype": ACC_DTYPE},
    )


def _infer_sum(op, call):
    data, s, z = call.args
    dt = check_dtype(op, "data", data, ["int8", "uint8", "int16"])
    check_qparams(op, s, z, dt, None, None)
    shape = dims(data)
    if shape is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=-1)
    axes = sorted(a % len(shape) for a in attr(call, "axis"))
    keep = bool(attr(call, "keepdims"))
    out = (
        [1 if i in axes else d for i, d in enumerate(shape)]
        if keep
        else [d for i, d in enumerate(shape) if i not in axes]
    )
    return tensor_type(out, ACC_DTYPE)


def _legalize_sum(bb, call):
    data, _s, z = call.args
    return relax.op.sum(
        _centered(data, z), axis=attr(call, "axis"), keepdims=bool(attr(call, "keepdims"))
    )


register(sum, _infer_sum, _legalize_sum)
