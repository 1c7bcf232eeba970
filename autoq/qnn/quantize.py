"""``qnn.quantize``, ``qnn.dequantize`` and ``qnn.requantize``: moving between float32 and
integers, and between two integer grids (float or integer-only rounding)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te

from autoq import primitives as P
from autoq.ir.toolkit import const_array
from autoq.qnn.checks import (
    ACC_DTYPE,
    QDTYPES,
    attr,
    check_dtype,
    check_out_dtype,
    check_qparams,
    check_rounding,
    dims,
    fail,
    tensor_type,
)
from autoq.qnn.registration import make_call, register
from autoq.qnn.tensor_exprs import (
    call_te,
    clip_int64,
    dequantize_tensor,
    dequantize_value,
    fixed_point_multiply,
    param_at,
    quantize_tensor,
    quantize_value,
)

__all__ = [
    "constant_scales",
    "dequantize",
    "legalize_dequantize_as",
    "quantize",
    "requantize",
]


def quantize(data, scale, zero_point, axis: int = -1, out_dtype: str = "int8") -> relax.Call:
    """``clip(round_half_even(data / scale) + zero_point)`` as ``out_dtype`` (float32 in)."""
    return make_call(
        "qnn.quantize", [data, scale, zero_point], {"axis": axis, "out_dtype": out_dtype}
    )


def _infer_quantize(op, call):
    data, scale, zp = call.args
    check_dtype(op, "data", data, ["float32"])
    out_dtype = attr(call, "out_dtype")
    check_out_dtype(op, out_dtype, QDTYPES)
    check_qparams(op, scale, zp, out_dtype, dims(data), attr(call, "axis"))
    return tensor_type(dims(data), out_dtype)


def _legalize_quantize(bb, call):
    out_dtype = attr(call, "out_dtype")
    qmin, qmax = P.qrange(out_dtype)
    axis = attr(call, "axis")
    x, s, z = call.args
    return call_te(
        bb,
        lambda x, s, z: quantize_tensor(x, s, z, axis, out_dtype, qmin, qmax),
        [x],
        [s, z],
        "qnn_quantize",
    )


register(quantize, _infer_quantize, _legalize_quantize)


def dequantize(data, scale, zero_point, axis: int = -1) -> relax.Call:
    """``float32(data - zero_point) * scale`` (int8/uint8/int16/uint16/int32 in)."""
    return make_call("qnn.dequantize", [data, scale, zero_point], {"axis": axis})


def _infer_dequantize(op, call):
    data, scale, zp = call.args
    dtype = check_dtype(op, "data", data, [*QDTYPES, ACC_DTYPE])
    check_qparams(op, scale, zp, dtype, dims(data), attr(call, "axis"))
    return tensor_type(dims(data), "float32")


def legalize_dequantize_as(name: str):
    """The legalization of a dequantize (real or simulated: the same TE) named ``name``."""

    def legalize(bb, call):
        axis = attr(call, "axis")
        x, s, z = call.args
        return call_te(bb, lambda x, s, z: dequantize_tensor(x, s, z, axis), [x], [s, z], name)

    return legalize


register(dequantize, _infer_dequantize, legalize_dequantize_as("qnn_dequantize"))


def requantize(
    data,
    input_scale,
    input_zero_point,
    output_scale,
    output_zero_point,
    axis: int = -1,
    out_dtype: str = "int8",
    rounding: str = "float",
    multiplier=None,
    shift=None,
) -> relax.Call:
    """Re-express ``data`` (int8/uint8/int16/int32) with new qparams; see primitives.requantize.

    ``multiplier``, ``shift`` (integer rounding modes only, both or neither): int32 tensors
    shaped like the scales with ``multiplier * 2**(shift - 31) ~= input_scale /
    output_scale`` (:func:`autoq.primitives.quantize_multiplier`); the legalization uses
    them instead of computing them from the scales. :func:`with_multipliers` adds them."""
    args = [data, input_scale, input_zero_point, output_scale, output_zero_point]
    if (multiplier is None) != (shift is None):
        raise ValueError("qnn.requantize: give both multiplier and shift, or neither")
    if multiplier is not None:
        args += [multiplier, shift]
    return make_call(
        "qnn.requantize", args, {"axis": axis, "out_dtype": out_dtype, "rounding": rounding}
    )


def with_multipliers(call: relax.Call, given: tuple | None = None) -> relax.Call:
    """An integer-rounding ``qnn.requantize`` with constant scales, its int32 multiplier and
    shift added as constant arguments (what a backend reads off the op): ``given`` (int32
    arrays shaped like the scales) or computed from the two scales; other calls (float
    rounding, runtime scales, already explicit) are returned unchanged."""
    if len(call.args) != 5 or attr(call, "rounding") == "float":
        return call
    s_in, s_out = call.args[1], call.args[3]
    if const_array(s_in) is None or const_array(s_out) is None:
        return call
    if given is not None:
        m, sh = (relax.const(np.asarray(v, np.int32)) for v in given)
    else:
        m, sh = _integer_multiplier(call.op.name, s_in, s_out)
    return tvm.ir.Call(call.op, [*call.args, m, sh], call.attrs, list(call.ty_args))


def _infer_requantize(op, call):
    if len(call.args) not in (5, 7):
        fail(op, "arguments", "5, or 7 with multiplier and shift", len(call.args))
    data, s_in, z_in, s_out, z_out, *given = call.args
    in_dtype = check_dtype(op, "data", data, [*QDTYPES, ACC_DTYPE])
    out_dtype = attr(call, "out_dtype")
    check_out_dtype(op, out_dtype, (*QDTYPES, ACC_DTYPE))
    rounding = attr(call, "rounding")
    check_rounding(op, rounding)
    shape, axis = dims(data), attr(call, "axis")
    check_qparams(op, s_in, z_in, in_dtype, shape, axis, ("input_scale", "input_zero_point"))
    check_qparams(op, s_out, z_out, out_dtype, shape, axis, ("output_scale", "output_zero_point"))
    if given and rounding == "float":
        fail(op, "multiplier", "no multiplier/shift with rounding='float'", "both")
    for name, e in zip(("multiplier", "shift"), given, strict=False):
        check_dtype(op, name, e, ["int32"])
    return tensor_type(shape, out_dtype)


def constant_scales(op: str, scales: dict, why: str) -> list[np.ndarray]:
    """The values of scale arguments (``{argument name: expression}``) that integer rounding
    modes need at compile time; a runtime scale is an error naming the argument."""
    values = []
    for name, e in scales.items():
        v = const_array(e)
        if v is None:
            got = f"a non-constant {type(e).__name__}"
            fail(op, name, f"a constant for integer rounding modes ({why})", got)
        values.append(v)
    return values


def _integer_multiplier(op, s_in, s_out):
    """Constant int32 multiplier/shift arrays for the integer rounding modes."""
    a, b = constant_scales(
        op,
        {"input_scale": s_in, "output_scale": s_out},
        "the multiplier is computed at compile time; use rounding='float' for runtime scales",
    )
    m, sh = P.quantize_multiplier(a.astype(np.float64) / b.astype(np.float64))
    return relax.const(np.asarray(m, np.int32)), relax.const(np.asarray(sh, np.int32))


def _legalize_requantize(bb, call):
    out_dtype, axis, rounding = attr(call, "out_dtype"), attr(call, "axis"), attr(call, "rounding")
    qmin, qmax = P.qrange(out_dtype)
    x, s_in, z_in, s_out, z_out, *given = call.args
    if rounding == "float":
        clip_dtype = "float64" if out_dtype == ACC_DTYPE else "float32"

        def f(x, si, zi, so, zo):
            def g(*i):
                r = dequantize_value(x[i], param_at(si, i, axis), param_at(zi, i, axis))
                return quantize_value(
                    r, param_at(so, i, axis), param_at(zo, i, axis), qmin, qmax, clip_dtype
                ).astype(out_dtype)

            return te.compute(x.shape, g, name="requantize")

        return call_te(bb, f, [], [x, s_in, z_in, s_out, z_out], "qnn_requantize")
    m, sh = given if given else _integer_multiplier("qnn.requantize", s_in, s_out)

    def f_int(x, zi, zo, m, sh):
        def g(*i):
            d = x[i].astype("int64") - param_at(zi, i, axis).astype("int64")
            y = fixed_point_multiply(d, param_at(m, i, axis), param_at(sh, i, axis), rounding)
            return clip_int64(y + param_at(zo, i, axis).astype("int64"), qmin, qmax, out_dtype)

        return te.compute(x.shape, g, name="requantize")

    return call_te(bb, f_int, [], [x, z_in, z_out, m, sh], "qnn_requantize")


register(requantize, _infer_requantize, _legalize_requantize)
