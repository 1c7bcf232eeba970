"""``qnn.simulated_quantize`` and ``qnn.simulated_dequantize``: float32 in, float32 out,
holding the integers the real ops would produce (the calibration graphs)."""

from __future__ import annotations

import re

from tvm import relax, te, tirx

from autoq import primitives as P
from autoq.qnn.checks import attr, check_dtype, check_qparams, dims, fail, static_int, tensor_type
from autoq.qnn.registration import make_call, register
from autoq.qnn.tensor_exprs import call_te_any_shape, dequantize_tensor, param_at, quantize_value

__all__ = ["simulated_dequantize", "simulated_quantize"]


def simulated_dequantize(data, scale, zero_point, axis: int = -1) -> relax.Call:
    """``(data - zero_point) * scale`` on float32 integers (exactly like ``dequantize``)."""
    return make_call("qnn.simulated_dequantize", [data, scale, zero_point], {"axis": axis})


def _infer_simulated_dequantize(op, call):
    data, scale, zp = call.args
    check_dtype(op, "data", data, ["float32"])
    check_qparams(op, scale, zp, None, dims(data), attr(call, "axis"))
    return tensor_type(dims(data), "float32")


def _legalize_simulated_dequantize(bb, call):
    # (one kernel per rank and parameter shape kind, whatever the shapes: calibration
    # graphs dequantize every layer's weights and activations)
    axis = attr(call, "axis")
    x, s, z = call.args
    f = lambda x, s, z: dequantize_tensor(x, s, z, axis)  # noqa: E731
    return call_te_any_shape(bb, f, [x], [s, z], "qnn_sim_dequantize")


register(simulated_dequantize, _infer_simulated_dequantize, _legalize_simulated_dequantize)


def simulated_quantize(
    data: relax.Expr,
    scale: relax.Expr,
    zero_point: relax.Expr,
    axis: int = -1,
    dtype: str = "int8",
    overflow: str = "saturate",
    enable=None,
) -> relax.Call:
    """float32 -> float32 holding the integers ``quantize`` would produce for ``dtype``.

    ``dtype`` may be any of int2..int32 / uint2..uint16 written ``"intN"``/``"uintN"``;
    ``overflow="wrap"`` wraps instead of saturating (to simulate a narrow accumulator:
    ``simulated_quantize(acc, 1.0, 0, dtype="int16", overflow="wrap")``).

    ``enable`` (optional, a float32 scalar, usually a runtime input) is a switch: non-zero
    gives the quantized integers above; zero gives ``data / scale + zero_point`` *unrounded
    and unclipped*, so that the ``simulated_dequantize`` and integer-valued accumulations
    downstream compute the float result (up to float32 rounding). Used by
    :mod:`autoq.fallback.analysis` to turn single layers off without recompiling; without it the op
    is unchanged.
    """
    args = [data, scale, zero_point] if enable is None else [data, scale, zero_point, enable]
    return make_call(
        "qnn.simulated_quantize",
        args,
        {"axis": axis, "dtype": dtype, "overflow": overflow},
    )


def _sim_range(op, dtype):
    m = re.fullmatch(r"(u?)int(\d+)", str(dtype))
    if not m or not (2 <= int(m.group(2)) <= 32) or (m.group(1) and int(m.group(2)) > 16):
        fail(op, "dtype", "intN (N in 2..32) or uintN (N in 2..16)", dtype)
    bits = int(m.group(2))
    if m.group(1):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _infer_simulated_quantize(op, call):
    if len(call.args) not in (3, 4):
        fail(op, "arguments", "(data, scale, zero_point[, enable])", f"{len(call.args)} arguments")
    data, scale, zp = call.args[:3]
    check_dtype(op, "data", data, ["float32"])
    if len(call.args) == 4:
        en = call.args[3]
        check_dtype(op, "enable", en, ["float32"])
        shape = dims(en)
        if shape is not None and not (
            len(shape) == 0 or (len(shape) == 1 and static_int(shape[0]) == 1)
        ):
            fail(op, "enable", "a float32 scalar", shape)
    overflow = attr(call, "overflow")
    if overflow not in ("saturate", "wrap"):
        fail(op, "overflow", "'saturate' or 'wrap'", overflow)
    dtype = attr(call, "dtype")
    _sim_range(op, dtype)
    qdtype = dtype if dtype in P.INT_RANGES else None
    check_qparams(op, scale, zp, qdtype, dims(data), attr(call, "axis"))
    return tensor_type(dims(data), "float32")


def _wrap(x, s, z, qmin, qmax):
    """Two's complement modulo 2**bits of the rounded value, computed exactly in float64."""
    w = (te.round(x / s) + z.astype("float32")).astype("float64")
    span = tirx.const(float(qmax - qmin + 1), "float64")
    w = w - tirx.const(float(qmin), "float64")
    w = w - te.floor(w / span) * span
    return (w + tirx.const(float(qmin), "float64")).astype("float32")


def _legalize_simulated_quantize(bb, call):
    axis, overflow = attr(call, "axis"), attr(call, "overflow")
    qmin, qmax = _sim_range("qnn.simulated_quantize", attr(call, "dtype"))

    def f(x, s, z, *en):
        def g(*i):
            si, zi = param_at(s, i, axis), param_at(z, i, axis)
            if overflow == "saturate":
                v = quantize_value(x[i], si, zi, qmin, qmax)
            else:
                v = _wrap(x[i], si, zi, qmin, qmax)
            if not en:
                return v
            # the switch: off = the unrounded, unclipped value (the float path)
            e = param_at(en[0], i, 0)
            return tirx.Select(e != tirx.const(0.0, "float32"), v, x[i] / si + zi.astype("float32"))

        return te.compute(x.shape, g, name="simulated_quantize")

    args = list(call.args)
    return call_te_any_shape(bb, f, args[:1], args[1:], "qnn_sim_quantize")


register(simulated_quantize, _infer_simulated_quantize, _legalize_simulated_quantize)
