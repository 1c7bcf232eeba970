"""The ``qnn.*`` op set: quantized operators as real Relax ops, registered from Python.

TVM 0.27 has no QNN dialect; this module defines one. Importing it registers every op
(``RegisterOp`` + ``FInferType`` + ``FPurity``) and its legalization, so the ops type-check,
print, serialize, and compile with ``tvm.compile`` on any target that Relax legalizes for.

One convention everywhere (see ``docs/ops.md`` for the table):

* every quantized operand is followed by its ``scale`` (float32) and ``zero_point`` (int32),
  each a scalar (per-tensor) or a 1-D tensor (per-axis); constants in a deployed graph,
  runtime inputs during calibration;
* real value = ``(q - zero_point) * scale``;
* per-axis parameters index the ``axis`` attribute's dimension; for ``qnn.conv2d`` and
  ``qnn.dense`` the weight's parameters index its output-channel dimension;
* ops that accumulate (``conv2d``, ``dense``, ``matmul``, ``sum``) return int32 with scale
  ``input_scale * weight_scale`` (per output channel) and zero point 0; the following
  ``qnn.requantize`` or ``qnn.dequantize`` carries that product as its input scale;
* elementwise ops (``add``, ``subtract``, ``multiply``) take their own output scale and
  zero point and return int8/uint8;
* ``rounding`` (requantize and elementwise ops): ``float`` (default) computes in float32
  exactly like ``quantize(dequantize(x))``; the integer-only modes are listed in
  :data:`autoq.primitives.ROUNDING_MODES`.

The builder functions below (``conv2d(...)`` etc.) return ``tvm.ir.Call`` nodes with the
attributes in a ``DictAttrs``; type inference checks dtypes, shapes, per-axis lengths and,
when they are constants, that scales are positive and zero points inside the dtype's range,
and raises ``QnnError`` naming the op, the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.ir import _ffi_api as _ir_ffi
from tvm.relax.transform.legalize_ops.common import register_legalize
from tvm_ffi import register_error

from . import primitives as P

__all__ = [
    "OPS",
    "QnnError",
    "add",
    "conv2d",
    "dense",
    "dequantize",
    "matmul",
    "multiply",
    "quantize",
    "requantize",
    "simulated_dequantize",
    "simulated_quantize",
    "subtract",
    "sum",
]

QDTYPES = ("int8", "uint8", "int16", "uint16")
ACC_DTYPE = "int32"
#: operand dtypes of the accumulating ops (conv2d, dense, matmul). 8-bit operands lower to
#: 8-bit kernels with an int32 accumulator; int16 operands (mixed precision for sensitive
#: layers) widen to int32 first. An int16 x int8 product reaches 2**22, so the int32
#: accumulator has far less headroom, and the *simulated* graph (float32 integers, exact
#: below 2**24) stops predicting the integer graph bit for bit once |acc| >= 2**24: with
#: int16 activations that is ~130 full-scale products (e.g. a 3x3 conv over 15 channels).
ACC_INPUT_DTYPES = ("int8", "uint8", "int16")


@register_error
class QnnError(ValueError):
    """A qnn op was given an argument of the wrong dtype, shape or value.

    Registered with tvm_ffi so that it keeps its type when raised inside type inference or
    legalization (Python callbacks called through the FFI); unregistered exception types
    come back from the FFI as a plain ``RuntimeError``.
    """


# --------------------------------------------------------------------------- helpers


def _ty(expr) -> relax.TensorType:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType):
        raise QnnError(f"expected a tensor, got {ty}")
    return ty


def _dims(expr):
    """Static or symbolic dims of a tensor expression, or None if the rank is unknown."""
    ty = _ty(expr)
    if ty.shape is None:
        return None
    return list(ty.shape.values)


def _int(d):
    return int(d) if isinstance(d, int | tirx.IntImm) else None


def _const_value(expr) -> np.ndarray | None:
    if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.value, tvm.runtime.Tensor):
        return expr.value.numpy()
    return None


def _fail(op: str, arg: str, expected: str, got) -> None:
    if isinstance(got, list | tuple | tvm.ir.Array):  # shapes: [3, 4], not [T.int64(3), ...]
        got = [_int(d) if _int(d) is not None else d for d in got]
    raise QnnError(f"{op}: argument '{arg}' must be {expected}, got {got}")


def _check_dtype(op: str, arg: str, expr, allowed: Sequence[str]) -> str:
    dtype = str(_ty(expr).dtype)
    if dtype not in allowed:
        _fail(op, arg, "of dtype " + " or ".join(allowed), dtype)
    return dtype


def _check_qparams(
    op: str,
    scale,
    zero_point,
    qdtype: str | None,
    data_dims,
    axis: int | None,
    names: tuple[str, str] = ("scale", "zero_point"),
) -> None:
    """Check a (scale, zero_point) pair against the tensor it describes."""
    sname, zname = names
    _check_dtype(op, sname, scale, ["float32"])
    _check_dtype(op, zname, zero_point, ["int32"])
    for name, e in ((sname, scale), (zname, zero_point)):
        ndim = _ty(e).ndim
        if ndim not in (0, 1, -1):
            _fail(op, name, "a scalar or a 1-D tensor", f"a {ndim}-D tensor")
    sdims, zdims = _dims(scale), _dims(zero_point)
    slen = _int(sdims[0]) if sdims else 1
    zlen = _int(zdims[0]) if zdims else 1
    if slen is not None and zlen is not None and slen != zlen and 1 not in (slen, zlen):
        _fail(op, zname, f"of length {slen} like '{sname}' (or a scalar)", f"length {zlen}")
    if data_dims is not None and axis is not None and len(data_dims) == 0:
        # 0-d data: any axis (the default is -1) is fine with per-tensor parameters
        for name, n in ((sname, slen), (zname, zlen)):
            if n != 1:
                _fail(op, name, "a scalar (the data is 0-d)", f"length {n}")
    elif data_dims is not None and axis is not None and (slen != 1 or zlen != 1):
        # the axis only matters (and is only checked) for per-axis parameters: ONNX's
        # default axis=1 comes with per-tensor parameters on 1-D data, for example
        ndim = len(data_dims)
        if not -ndim <= axis < ndim:
            _fail(op, "axis", f"in [{-ndim}, {ndim})", axis)
        for name, n in ((sname, slen), (zname, zlen)):
            if n is None or n == 1:
                continue
            d = _int(data_dims[axis % ndim])
            if d is not None and d != n:
                _fail(
                    op,
                    name,
                    f"of length {d} (dimension {axis} of the data) or a scalar",
                    f"length {n}",
                )
    s = _const_value(scale)
    if s is not None and not (np.all(np.isfinite(s)) and np.all(s > 0)):
        bad = s[~(np.isfinite(s) & (s > 0))]
        _fail(op, sname, "positive and finite", f"{bad.ravel()[:4].tolist()}")
    z = _const_value(zero_point)
    if z is not None and qdtype is not None:
        lo, hi = P.qrange(qdtype)
        if np.any(z < lo) or np.any(z > hi):
            bad = z[(z < lo) | (z > hi)]
            _fail(
                op, zname, f"inside the {qdtype} range [{lo}, {hi}]", f"{bad.ravel()[:4].tolist()}"
            )


def _attr(call, name, default=None):
    attrs = call.attrs
    if attrs is None or name not in attrs:
        return default
    v = attrs[name]
    if isinstance(v, str | bool | int | float):
        return v
    if isinstance(v, tirx.IntImm):
        return int(v)
    try:  # an FFI array
        return [int(x) if isinstance(x, tirx.IntImm | int) else x for x in v]
    except TypeError:
        return v


def _call(name: str, args, attrs: dict) -> relax.Call:
    return tvm.ir.Call(tvm.ir.Op.get(name), [a for a in args], attrs)


def _tensor_type(dims, dtype) -> relax.TensorType:
    if dims is None:
        return relax.TensorType(dtype=dtype, ndim=-1)
    return relax.TensorType(dims, dtype)


def _broadcast_dims(op, a, b):
    if a is None or b is None:
        return None
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        xi, yi = _int(x), _int(y)
        if xi == 1:
            out.append(y)
        elif yi == 1 or (xi is not None and xi == yi):
            out.append(x)
        elif xi is not None and yi is not None:
            raise QnnError(f"{op}: shapes {a} and {b} do not broadcast")
        else:
            out.append(x)
    return out[::-1]


# ------------------------------------------------------------- TE building blocks
# The same TE expressions serve the real ops and the simulated ones, so that the
# simulated graph predicts the integer graph bit for bit.


def _pval(p, idx, axis):
    """Value of a scalar / per-axis parameter (TE tensor or Python number) at index idx."""
    if not isinstance(p, te.Tensor):  # a Python number or an immediate
        return p
    if len(p.shape) == 0:
        return p[()]
    if _int(p.shape[0]) == 1:
        return p[0]
    return p[idx[axis % len(idx)]]


def _scalar_or_tensor(bb, expr):
    """Pass scalar constants to TE as immediates (simpler code), everything else as tensors."""
    v = _const_value(expr)
    if v is not None and v.ndim == 0:
        return tirx.const(v.item(), str(v.dtype))
    return expr


def _te_quantize_value(x, s, z, qmin, qmax, clip_dtype="float32"):
    """float32 ``clip(round_half_even(x / s) + z, qmin, qmax)`` (still a float).

    ``clip_dtype="float64"`` clips in float64, for int32 outputs: float32 cannot hold
    2**31 - 1, and converting the float32 bound 2**31 to int32 overflows.
    """
    v = te.round(x / s) + z.astype("float32")
    if clip_dtype != "float32":
        v = v.astype(clip_dtype)
    return te.max(
        te.min(v, tirx.const(float(qmax), clip_dtype)), tirx.const(float(qmin), clip_dtype)
    )


def _te_dequantize_value(q, s, z):
    """``float32(q - z) * s``; q is any int dtype or an integral float.

    The subtraction is exact: in int32 for 8/16-bit data, in int64 for int32 data (an int32
    accumulator minus a zero point can leave the int32 range), like primitives.dequantize.
    """
    if "float" in str(q.dtype):
        return (q - z.astype(q.dtype)).astype("float32") * s
    wide = "int64" if str(q.dtype) == "int32" else "int32"
    return (q.astype(wide) - z.astype(wide)).astype("float32") * s


def _te_quantize(x, s, z, axis, out_dtype, qmin, qmax):
    def f(*i):
        return _te_quantize_value(x[i], _pval(s, i, axis), _pval(z, i, axis), qmin, qmax).astype(
            out_dtype
        )

    return te.compute(x.shape, f, name="quantize")


def _te_dequantize(q, s, z, axis):
    return te.compute(
        q.shape,
        lambda *i: _te_dequantize_value(q[i], _pval(s, i, axis), _pval(z, i, axis)),
        name="dequantize",
    )


def _te_rshift_round(x, shift, mode):
    """int64 ``round(x / 2**shift)`` with a tie rule (shift >= 0, an int64 PrimExpr)."""
    one = tirx.const(1, "int64")
    zero = tirx.const(0, "int64")
    floor = x >> shift
    rem = x - (floor << shift)
    # te.max keeps the shift amount non-negative in the branch Select does not take: with a
    # constant shift of 0, ``one << (shift - one)`` would be folded to an invalid ``1 << -1``
    half = tirx.Select(shift > zero, one << te.max(shift - one, zero), zero)
    if mode == "half_up":
        up = rem >= half
    elif mode == "half_away":
        up = tirx.Or(rem > half, tirx.And(rem == half, x >= zero))
    elif mode == "half_even":
        up = tirx.Or(rem > half, tirx.And(rem == half, (floor & one) == one))
    else:
        raise QnnError(f"unknown tie rule {mode!r}")
    return floor + tirx.Select(tirx.And(up, shift > zero), one, zero)


def _te_fixed_point_multiply(x, m, shift, rounding):
    """Mirror of :func:`autoq.primitives.fixed_point_multiply` on int64 PrimExprs."""
    i64 = "int64"
    x = x.astype(i64)
    m = m.astype(i64)
    shift = shift.astype(i64)
    zero = tirx.const(0, i64)
    if rounding == "tflite":
        left = te.max(shift, zero)
        right = te.max(-shift, zero)
        lo, hi = tirx.const(-(2**31), i64), tirx.const(2**31 - 1, i64)
        xs = te.max(te.min(x << left, hi), lo)
        ab = xs * m
        nudge = tirx.Select(ab >= zero, tirx.const(1 << 30, i64), tirx.const(1 - (1 << 30), i64))
        high = tirx.truncdiv(ab + nudge, tirx.const(1 << 31, i64))
        high = tirx.Select(tirx.And(xs == lo, m == lo), hi, high)
        return _te_rshift_round(high, right, "half_away")
    mode = "half_up" if rounding == "tflite_single" else rounding
    total = tirx.const(31, i64) - shift
    prod = x * m
    return tirx.Select(
        total < zero,
        prod << te.max(-total, zero),
        _te_rshift_round(prod, te.max(total, zero), mode),
    )


def _rounding_check(op, rounding):
    if rounding not in P.ROUNDING_MODES:
        _fail(op, "rounding", "one of " + ", ".join(P.ROUNDING_MODES), repr(rounding))


# ------------------------------------------------------------------ registration

OPS: dict[str, str] = {}


def _register(name: str, doc: str, infer: Callable, legalize: Callable) -> None:
    full = "qnn." + name
    try:
        op = tvm.ir.Op.get(full)
    except Exception:
        _ir_ffi.RegisterOp(full, doc)
        op = tvm.ir.Op.get(full)
    if op.get_attr("FInferType") is None:  # not yet registered in this process

        def f_infer(call, ctx, _infer=infer, _name=full):
            return _infer(_name, call)

        op.set_attr("FInferType", f_infer)
        op.set_attr("FPurity", True)
        register_legalize(full, legalize)
    OPS[full] = doc


# ---- quantize / dequantize / requantize


def quantize(data, scale, zero_point, axis: int = -1, out_dtype: str = "int8") -> relax.Call:
    """``clip(round_half_even(data / scale) + zero_point)`` as ``out_dtype`` (float32 in)."""
    return _call("qnn.quantize", [data, scale, zero_point], {"axis": axis, "out_dtype": out_dtype})


def _infer_quantize(op, call):
    data, scale, zp = call.args
    _check_dtype(op, "data", data, ["float32"])
    out_dtype = _attr(call, "out_dtype")
    if out_dtype not in QDTYPES:
        _fail(op, "out_dtype", "one of " + ", ".join(QDTYPES), out_dtype)
    _check_qparams(op, scale, zp, out_dtype, _dims(data), _attr(call, "axis"))
    return _tensor_type(_dims(data), out_dtype)


def _legalize_quantize(bb, call):
    out_dtype = _attr(call, "out_dtype")
    qmin, qmax = P.qrange(out_dtype)
    axis = _attr(call, "axis")
    x, s, z = call.args
    return bb.call_te(
        lambda x, s, z: _te_quantize(x, s, z, axis, out_dtype, qmin, qmax),
        x,
        _scalar_or_tensor(bb, s),
        _scalar_or_tensor(bb, z),
        primfunc_name_hint="qnn_quantize",
    )


_register(
    "quantize",
    "Quantize float32 to int8/uint8/int16/uint16: clip(round_half_even(x / scale) + zero_point).",
    _infer_quantize,
    _legalize_quantize,
)


def dequantize(data, scale, zero_point, axis: int = -1) -> relax.Call:
    """``float32(data - zero_point) * scale`` (int8/uint8/int16/uint16/int32 in)."""
    return _call("qnn.dequantize", [data, scale, zero_point], {"axis": axis})


def _infer_dequantize(op, call):
    data, scale, zp = call.args
    dtype = _check_dtype(op, "data", data, [*QDTYPES, ACC_DTYPE])
    _check_qparams(op, scale, zp, dtype, _dims(data), _attr(call, "axis"))
    return _tensor_type(_dims(data), "float32")


def _legalize_dequantize(bb, call):
    axis = _attr(call, "axis")
    x, s, z = call.args
    return bb.call_te(
        lambda x, s, z: _te_dequantize(x, s, z, axis),
        x,
        _scalar_or_tensor(bb, s),
        _scalar_or_tensor(bb, z),
        primfunc_name_hint="qnn_dequantize",
    )


_register(
    "dequantize",
    "Dequantize to float32: float32(q - zero_point) * scale.",
    _infer_dequantize,
    _legalize_dequantize,
)


def requantize(
    data,
    input_scale,
    input_zero_point,
    output_scale,
    output_zero_point,
    axis: int = -1,
    out_dtype: str = "int8",
    rounding: str = "float",
) -> relax.Call:
    """Re-express ``data`` (int8/uint8/int16/int32) with new qparams; see primitives.requantize."""
    return _call(
        "qnn.requantize",
        [data, input_scale, input_zero_point, output_scale, output_zero_point],
        {"axis": axis, "out_dtype": out_dtype, "rounding": rounding},
    )


def _infer_requantize(op, call):
    data, s_in, z_in, s_out, z_out = call.args
    in_dtype = _check_dtype(op, "data", data, [*QDTYPES, ACC_DTYPE])
    out_dtype = _attr(call, "out_dtype")
    if out_dtype not in (*QDTYPES, ACC_DTYPE):
        _fail(op, "out_dtype", "one of " + ", ".join((*QDTYPES, ACC_DTYPE)), out_dtype)
    _rounding_check(op, _attr(call, "rounding"))
    dims, axis = _dims(data), _attr(call, "axis")
    _check_qparams(op, s_in, z_in, in_dtype, dims, axis, ("input_scale", "input_zero_point"))
    _check_qparams(op, s_out, z_out, out_dtype, dims, axis, ("output_scale", "output_zero_point"))
    return _tensor_type(dims, out_dtype)


def _integer_multiplier(op, s_in, s_out):
    """Constant int32 multiplier/shift arrays for the integer rounding modes."""
    a, b = _const_value(s_in), _const_value(s_out)
    for name, v, e in (("input_scale", a, s_in), ("output_scale", b, s_out)):
        if v is None:
            _fail(
                op,
                name,
                "a constant for integer rounding modes (the multiplier is computed at compile "
                "time; use rounding='float' for runtime scales)",
                f"a non-constant {type(e).__name__}",
            )
    m, sh = P.quantize_multiplier(a.astype(np.float64) / b.astype(np.float64))
    return relax.const(np.asarray(m, np.int32)), relax.const(np.asarray(sh, np.int32))


def _legalize_requantize(bb, call):
    op = "qnn.requantize"
    out_dtype, axis, rounding = (
        _attr(call, "out_dtype"),
        _attr(call, "axis"),
        _attr(call, "rounding"),
    )
    qmin, qmax = P.qrange(out_dtype)
    x, s_in, z_in, s_out, z_out = call.args
    if rounding == "float":
        clip_dtype = "float64" if out_dtype == ACC_DTYPE else "float32"

        def f(x, si, zi, so, zo):
            def g(*i):
                r = _te_dequantize_value(x[i], _pval(si, i, axis), _pval(zi, i, axis))
                return _te_quantize_value(
                    r, _pval(so, i, axis), _pval(zo, i, axis), qmin, qmax, clip_dtype
                ).astype(out_dtype)

            return te.compute(x.shape, g, name="requantize")

        args = [x, s_in, z_in, s_out, z_out]
    else:
        m, sh = _integer_multiplier(op, s_in, s_out)

        def f(x, zi, zo, m, sh):
            def g(*i):
                d = x[i].astype("int64") - _pval(zi, i, axis).astype("int64")
                y = _te_fixed_point_multiply(d, _pval(m, i, axis), _pval(sh, i, axis), rounding)
                y = y + _pval(zo, i, axis).astype("int64")
                return te.max(
                    te.min(y, tirx.const(qmax, "int64")), tirx.const(qmin, "int64")
                ).astype(out_dtype)

            return te.compute(x.shape, g, name="requantize")

        args = [x, z_in, z_out, m, sh]
    return bb.call_te(
        f, *[_scalar_or_tensor(bb, a) for a in args], primfunc_name_hint="qnn_requantize"
    )


_register(
    "requantize",
    "Requantize to new scale/zero point; rounding attribute selects float or integer-only modes.",
    _infer_requantize,
    _legalize_requantize,
)


# ---- simulated quantize / dequantize (float32 in, float32 out)


def simulated_quantize(
    data,
    scale,
    zero_point,
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
    :mod:`autoq.analyze` to turn single layers off without recompiling; without it the op
    is unchanged.
    """
    args = [data, scale, zero_point] if enable is None else [data, scale, zero_point, enable]
    return _call(
        "qnn.simulated_quantize",
        args,
        {"axis": axis, "dtype": dtype, "overflow": overflow},
    )


def _sim_range(op, dtype):
    import re

    m = re.fullmatch(r"(u?)int(\d+)", str(dtype))
    if not m or not (2 <= int(m.group(2)) <= 32) or (m.group(1) and int(m.group(2)) > 16):
        _fail(op, "dtype", "intN (N in 2..32) or uintN (N in 2..16)", dtype)
    bits = int(m.group(2))
    if m.group(1):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _infer_simulated_quantize(op, call):
    if len(call.args) not in (3, 4):
        _fail(op, "arguments", "(data, scale, zero_point[, enable])", f"{len(call.args)} arguments")
    data, scale, zp = call.args[:3]
    _check_dtype(op, "data", data, ["float32"])
    if len(call.args) == 4:
        en = call.args[3]
        _check_dtype(op, "enable", en, ["float32"])
        dims = _dims(en)
        if dims is not None and not (len(dims) == 0 or (len(dims) == 1 and _int(dims[0]) == 1)):
            _fail(op, "enable", "a float32 scalar", dims)
    overflow = _attr(call, "overflow")
    if overflow not in ("saturate", "wrap"):
        _fail(op, "overflow", "'saturate' or 'wrap'", overflow)
    dtype = _attr(call, "dtype")
    _sim_range(op, dtype)
    _check_qparams(
        op, scale, zp, dtype if dtype in P._INT_RANGES else None, _dims(data), _attr(call, "axis")
    )
    return _tensor_type(_dims(data), "float32")


def _legalize_simulated_quantize(bb, call):
    axis, overflow = _attr(call, "axis"), _attr(call, "overflow")
    qmin, qmax = _sim_range("qnn.simulated_quantize", _attr(call, "dtype"))
    x, s, z = call.args[:3]
    switched = len(call.args) == 4

    def f(x, s, z, *en):
        def g(*i):
            si, zi = _pval(s, i, axis), _pval(z, i, axis)
            if overflow == "saturate":
                v = _te_quantize_value(x[i], si, zi, qmin, qmax)
            else:
                # wrap: two's complement modulo 2**bits, computed exactly in float64
                w = (te.round(x[i] / si) + zi.astype("float32")).astype("float64")
                span = tirx.const(float(qmax - qmin + 1), "float64")
                w = w - tirx.const(float(qmin), "float64")
                w = w - te.floor(w / span) * span
                v = (w + tirx.const(float(qmin), "float64")).astype("float32")
            if not en:
                return v
            # the switch: off = the unrounded, unclipped value (the float path)
            e = _pval(en[0], i, 0)
            return tirx.Select(e != tirx.const(0.0, "float32"), v, x[i] / si + zi.astype("float32"))

        return te.compute(x.shape, g, name="simulated_quantize")

    args = [x, _scalar_or_tensor(bb, s), _scalar_or_tensor(bb, z)]
    if switched:
        args.append(_scalar_or_tensor(bb, call.args[3]))
    return bb.call_te(f, *args, primfunc_name_hint="qnn_sim_quantize")


_register(
    "simulated_quantize",
    "float32 -> float32 integers that quantize would produce (calibration graphs).",
    _infer_simulated_quantize,
    _legalize_simulated_quantize,
)


def simulated_dequantize(data, scale, zero_point, axis: int = -1) -> relax.Call:
    """``(data - zero_point) * scale`` on float32 integers (exactly like ``dequantize``)."""
    return _call("qnn.simulated_dequantize", [data, scale, zero_point], {"axis": axis})


def _infer_simulated_dequantize(op, call):
    data, scale, zp = call.args
    _check_dtype(op, "data", data, ["float32"])
    _check_qparams(op, scale, zp, None, _dims(data), _attr(call, "axis"))
    return _tensor_type(_dims(data), "float32")


def _legalize_simulated_dequantize(bb, call):
    axis = _attr(call, "axis")
    x, s, z = call.args
    return bb.call_te(
        lambda x, s, z: _te_dequantize(x, s, z, axis),
        x,
        _scalar_or_tensor(bb, s),
        _scalar_or_tensor(bb, z),
        primfunc_name_hint="qnn_sim_dequantize",
    )


_register(
    "simulated_dequantize",
    "float32 integers -> float32 real values: (q - zero_point) * scale.",
    _infer_simulated_dequantize,
    _legalize_simulated_dequantize,
)


# ---- accumulating ops: conv2d, dense, matmul, sum (int32 out, zero point 0)


def _centered(x, zp, dtype="int32"):
    """Relax expression ``int32(x) - zp`` (the zero-point-free integer operand)."""
    xi = relax.op.astype(x, dtype)
    z = _const_value(zp)
    if z is not None and np.all(z == 0):
        return xi
    return relax.op.subtract(xi, zp)


def conv2d(
    data,
    weight,
    input_scale,
    input_zero_point,
    weight_scale,
    weight_zero_point,
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
    return _call(
        "qnn.conv2d",
        [data, weight, input_scale, input_zero_point, weight_scale, weight_zero_point],
        {
            "strides": list(strides),
            "padding": padding,
            "dilation": list(dilation),
            "groups": int(groups),
            "data_layout": data_layout,
            "kernel_layout": kernel_layout,
            "out_dtype": ACC_DTYPE,
        },
    )


def _infer_conv2d(op, call):
    data, weight, s_x, z_x, s_w, z_w = call.args
    xdt = _check_dtype(op, "data", data, ACC_INPUT_DTYPES)
    wdt = _check_dtype(op, "weight", weight, ACC_INPUT_DTYPES)
    if _attr(call, "data_layout") != "NCHW" or _attr(call, "kernel_layout") != "OIHW":
        _fail(
            op,
            "data_layout/kernel_layout",
            "NCHW/OIHW",
            (_attr(call, "data_layout"), _attr(call, "kernel_layout")),
        )
    xd, wd = _dims(data), _dims(weight)
    if xd is not None and len(xd) != 4:
        _fail(op, "data", "a 4-D NCHW tensor", f"{len(xd)}-D")
    if wd is not None and len(wd) != 4:
        _fail(op, "weight", "a 4-D OIHW tensor", f"{len(wd)}-D")
    _check_qparams(op, s_x, z_x, xdt, None, None, ("input_scale", "input_zero_point"))
    _check_qparams(op, s_w, z_w, wdt, wd, 0, ("weight_scale", "weight_zero_point"))
    for name in ("input_scale", "input_zero_point"):
        e = s_x if name == "input_scale" else z_x
        if _ty(e).ndim not in (0, -1) and _int(_dims(e)[0]) != 1:
            _fail(op, name, "a scalar (activations are quantized per tensor)", _dims(e))
    if xd is None or wd is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=4)
    groups = _attr(call, "groups")
    cin, ci_w = _int(xd[1]), _int(wd[1])
    if cin is not None and ci_w is not None and cin != ci_w * groups:
        _fail(op, "weight", f"of shape [O, {cin}/groups={cin // max(groups, 1)}, kH, kW]", wd)
    st, pad, dil = _attr(call, "strides"), _attr(call, "padding"), _attr(call, "dilation")
    oh = (xd[2] + pad[0] + pad[2] - dil[0] * (wd[2] - 1) - 1) // st[0] + 1
    ow = (xd[3] + pad[1] + pad[3] - dil[1] * (wd[3] - 1) - 1) // st[1] + 1
    return relax.TensorType([xd[0], wd[0], oh, ow], ACC_DTYPE)


def _scalar_zp(zp) -> int | None:
    """The zero point as a Python int when it is a constant with one value, else None."""
    z = _const_value(zp)
    if z is None or (z.size > 1 and not np.all(z == z.reshape(-1)[0])):
        return None
    return int(z.reshape(-1)[0])


def _int8_direct(data, weight, z_w) -> bool:
    """The fast lowering applies: 8-bit operands and an all-zero constant weight zero point
    (symmetric weights, the default): the op runs on the int8 values themselves."""
    return (
        str(_ty(data).dtype) in ("int8", "uint8")
        and str(_ty(weight).dtype) in ("int8", "uint8")
        and _scalar_zp(z_w) == 0
    )


def _zp_correction(bb, weight, zx: int, axes, shape):
    """``zx * sum(weight, axes)`` reshaped to broadcast over the accumulator (int32); folded
    to a constant when the weight is one."""
    w = _const_value(weight)
    if w is not None:
        return relax.const(
            (zx * w.astype(np.int64).sum(axis=tuple(axes))).astype(np.int32).reshape(shape)
        )
    wsum = bb.emit(relax.op.sum(relax.op.astype(weight, "int32"), axis=list(axes)))
    return relax.op.reshape(bb.emit(relax.op.multiply(wsum, relax.const(np.int32(zx)))), shape)


def _legalize_conv2d(bb, call):
    data, weight, _s_x, z_x, _s_w, z_w = call.args
    zx = _scalar_zp(z_x)
    if zx is not None and _int8_direct(data, weight, z_w):
        # conv(x - zx, w) = conv(pad_zx(x), w) - zx * sum(w): int8 operands, int32 accumulator
        # (about 2x faster than widening first). Padding must hold the zero point, so it is
        # done explicitly when zx != 0.
        pad = _attr(call, "padding")
        x = data
        if zx != 0 and any(pad):
            x = relax.op.nn.pad(
                data, [0, 0, 0, 0, pad[0], pad[2], pad[1], pad[3]], "constant", float(zx)
            )
            pad = [0, 0, 0, 0]
        acc = relax.op.nn.conv2d(
            x,
            weight,
            strides=_attr(call, "strides"),
            padding=pad,
            dilation=_attr(call, "dilation"),
            groups=_attr(call, "groups"),
            out_dtype=ACC_DTYPE,
        )
        if zx == 0:
            return acc
        return relax.op.subtract(acc, _zp_correction(bb, weight, zx, (1, 2, 3), [1, -1, 1, 1]))
    x = _centered(data, z_x)
    w = _centered(weight, relax.op.reshape(z_w, [-1, 1, 1, 1]) if _ty(z_w).ndim == 1 else z_w)
    return relax.op.nn.conv2d(
        x,
        w,
        strides=_attr(call, "strides"),
        padding=_attr(call, "padding"),
        dilation=_attr(call, "dilation"),
        groups=_attr(call, "groups"),
        out_dtype=ACC_DTYPE,
    )


_register(
    "conv2d",
    "int8/uint8/int16 NCHW x OIHW conv2d with zero points, int32 out (scale = input_scale*weight_scale).",
    _infer_conv2d,
    _legalize_conv2d,
)


def dense(
    data, weight, input_scale, input_zero_point, weight_scale, weight_zero_point
) -> relax.Call:
    """int32 ``(data - input_zp) @ (weight - weight_zp).T``; ``weight`` is ``[N, K]``.

    The weight's per-channel parameters index N (its axis 0). Scale of the result:
    ``input_scale * weight_scale`` along the last axis.
    """
    return _call(
        "qnn.dense",
        [data, weight, input_scale, input_zero_point, weight_scale, weight_zero_point],
        {"out_dtype": ACC_DTYPE},
    )


def _infer_dense(op, call):
    data, weight, s_x, z_x, s_w, z_w = call.args
    xdt = _check_dtype(op, "data", data, ACC_INPUT_DTYPES)
    wdt = _check_dtype(op, "weight", weight, ACC_INPUT_DTYPES)
    xd, wd = _dims(data), _dims(weight)
    if wd is not None and len(wd) != 2:
        _fail(op, "weight", "a 2-D [N, K] tensor", f"{len(wd)}-D")
    _check_qparams(op, s_x, z_x, xdt, None, None, ("input_scale", "input_zero_point"))
    _check_qparams(op, s_w, z_w, wdt, wd, 0, ("weight_scale", "weight_zero_point"))
    if xd is None or wd is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=-1)
    k, kw = _int(xd[-1]), _int(wd[1])
    if k is not None and kw is not None and k != kw:
        _fail(op, "weight", f"of shape [N, {k}] (K must match the data's last dimension)", wd)
    return relax.TensorType([*xd[:-1], wd[0]], ACC_DTYPE)


def _legalize_dense(bb, call):
    data, weight, _s_x, z_x, _s_w, z_w = call.args
    zx = _scalar_zp(z_x)
    if zx is not None and _int8_direct(data, weight, z_w):
        # (x - zx) @ w.T = x @ w.T - zx * sum_k(w): 8-bit operands, int32 accumulator
        acc = relax.op.matmul(data, relax.op.permute_dims(weight, [1, 0]), out_dtype=ACC_DTYPE)
        if zx == 0:
            return acc
        return relax.op.subtract(acc, _zp_correction(bb, weight, zx, (1,), [-1]))
    w = _centered(weight, relax.op.reshape(z_w, [-1, 1]) if _ty(z_w).ndim == 1 else z_w)
    return relax.op.matmul(
        _centered(data, z_x), relax.op.permute_dims(w, [1, 0]), out_dtype=ACC_DTYPE
    )


_register(
    "dense",
    "int8/uint8/int16 data [..., K] x weight [N, K] with zero points, int32 out [..., N].",
    _infer_dense,
    _legalize_dense,
)


def matmul(lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point) -> relax.Call:
    """int32 ``(lhs - lhs_zp) @ (rhs - rhs_zp)`` for two activations (per-tensor params)."""
    return _call(
        "qnn.matmul",
        [lhs, rhs, lhs_scale, lhs_zero_point, rhs_scale, rhs_zero_point],
        {"out_dtype": ACC_DTYPE},
    )


def _infer_matmul(op, call):
    a, b, s_a, z_a, s_b, z_b = call.args
    adt = _check_dtype(op, "lhs", a, ACC_INPUT_DTYPES)
    bdt = _check_dtype(op, "rhs", b, ACC_INPUT_DTYPES)
    _check_qparams(op, s_a, z_a, adt, None, None, ("lhs_scale", "lhs_zero_point"))
    _check_qparams(op, s_b, z_b, bdt, None, None, ("rhs_scale", "rhs_zero_point"))
    for name, e in (("lhs_scale", s_a), ("rhs_scale", s_b)):
        if _ty(e).ndim not in (0, -1) and _int(_dims(e)[0]) != 1:
            _fail(
                op, name, "a scalar (qnn.matmul is per-tensor; use qnn.dense for weights)", _dims(e)
            )
    ad, bd = _dims(a), _dims(b)
    if ad is None or bd is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=-1)
    if len(ad) < 2 or len(bd) < 2:
        _fail(op, "lhs/rhs", "tensors of rank >= 2", (ad, bd))
    k1, k2 = _int(ad[-1]), _int(bd[-2])
    if k1 is not None and k2 is not None and k1 != k2:
        _fail(op, "rhs", f"of shape [..., {k1}, N]", bd)
    batch = _broadcast_dims(op, ad[:-2], bd[:-2])
    return relax.TensorType([*batch, ad[-2], bd[-1]], ACC_DTYPE)


def _legalize_matmul(bb, call):
    a, b, _s_a, z_a, _s_b, z_b = call.args
    za, zb = _scalar_zp(z_a), _scalar_zp(z_b)
    eight_bit = all(str(_ty(t).dtype) in ("int8", "uint8") for t in (a, b))
    k = _int(_dims(a)[-1]) if _dims(a) is not None else None
    if za is None or zb is None or not eight_bit or (za and zb and k is None):
        # int16 operands, per-axis or unknown zero points, unknown K: widen to int32 first
        return relax.op.matmul(_centered(a, z_a), _centered(b, z_b), out_dtype=ACC_DTYPE)
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


_register(
    "matmul",
    "int8/uint8/int16 activation x activation matmul with zero points, int32 out.",
    _infer_matmul,
    _legalize_matmul,
)


def sum(data, scale, zero_point, axis: Sequence[int], keepdims: bool = False) -> relax.Call:
    """int32 ``sum(data - zero_point, axis)``; scale stays ``scale`` (a mean divides it by N)."""
    return _call(
        "qnn.sum",
        [data, scale, zero_point],
        {"axis": [int(a) for a in axis], "keepdims": bool(keepdims), "out_dtype": ACC_DTYPE},
    )


def _infer_sum(op, call):
    data, s, z = call.args
    dt = _check_dtype(op, "data", data, ["int8", "uint8", "int16"])
    _check_qparams(op, s, z, dt, None, None)
    dims = _dims(data)
    if dims is None:
        return relax.TensorType(dtype=ACC_DTYPE, ndim=-1)
    axes = sorted(a % len(dims) for a in _attr(call, "axis"))
    keep = bool(_attr(call, "keepdims"))
    out = (
        [1 if i in axes else d for i, d in enumerate(dims)]
        if keep
        else [d for i, d in enumerate(dims) if i not in axes]
    )
    return relax.TensorType(out, ACC_DTYPE)


def _legalize_sum(bb, call):
    data, _s, z = call.args
    return relax.op.sum(
        _centered(data, z), axis=_attr(call, "axis"), keepdims=bool(_attr(call, "keepdims"))
    )


_register("sum", "int32 sum of (data - zero_point) over axes.", _infer_sum, _legalize_sum)


# ---- elementwise ops with their own output qparams


def _elementwise(name):
    def build(
        lhs,
        rhs,
        lhs_scale,
        lhs_zero_point,
        rhs_scale,
        rhs_zero_point,
        output_scale,
        output_zero_point,
        out_dtype: str = "int8",
        rounding: str = "float",
    ) -> relax.Call:
        return _call(
            "qnn." + name,
            [
                lhs,
                rhs,
                lhs_scale,
                lhs_zero_point,
                rhs_scale,
                rhs_zero_point,
                output_scale,
                output_zero_point,
            ],
            {"out_dtype": out_dtype, "rounding": rounding},
        )

    build.__name__ = name
    build.__doc__ = (
        f"Quantized {name}: ``quantize(dequantize(lhs) {name} dequantize(rhs))`` with the output "
        "scale/zero point (per-tensor); integer-only for rounding != 'float' "
        "(see primitives.elementwise)."
    )
    return build


add = _elementwise("add")
subtract = _elementwise("subtract")
multiply = _elementwise("multiply")


def _infer_elementwise(op, call):
    a, b, s_a, z_a, s_b, z_b, s_o, z_o = call.args
    adt = _check_dtype(op, "lhs", a, ["int8", "uint8", "int16"])
    bdt = _check_dtype(op, "rhs", b, ["int8", "uint8", "int16"])
    out_dtype = _attr(call, "out_dtype")
    if out_dtype not in QDTYPES:
        _fail(op, "out_dtype", "one of " + ", ".join(QDTYPES), out_dtype)
    _rounding_check(op, _attr(call, "rounding"))
    for names, (s, z), dt in (
        (("lhs_scale", "lhs_zero_point"), (s_a, z_a), adt),
        (("rhs_scale", "rhs_zero_point"), (s_b, z_b), bdt),
        (("output_scale", "output_zero_point"), (s_o, z_o), out_dtype),
    ):
        _check_qparams(op, s, z, dt, None, None, names)
        if _ty(s).ndim not in (0, -1) and _int(_dims(s)[0]) != 1:
            _fail(op, names[0], "a scalar (elementwise qnn ops are per-tensor)", _dims(s))
    return _tensor_type(_broadcast_dims(op, _dims(a), _dims(b)), out_dtype)


_FLOAT_FN = {
    "qnn.add": lambda x, y: x + y,
    "qnn.subtract": lambda x, y: x - y,
    "qnn.multiply": lambda x, y: x * y,
}


def _legalize_elementwise(bb, call):
    op = call.op.name
    out_dtype, rounding = _attr(call, "out_dtype"), _attr(call, "rounding")
    qmin, qmax = P.qrange(out_dtype)
    a, b, s_a, z_a, s_b, z_b, s_o, z_o = call.args
    out_shape = [d for d in _ty(call).shape.values] if _ty(call).shape is not None else None
    if out_shape is None:
        raise QnnError(f"{op}: legalization needs a known output rank")
    ndim = len(out_shape)

    def idx(t, i):
        # numpy broadcasting index into t for output index i
        r = len(t.shape)
        out = []
        for k in range(r):
            j = i[ndim - r + k]
            out.append(0 if _int(t.shape[k]) == 1 else j)
        return t[tuple(out)]

    if rounding == "float":
        fn = _FLOAT_FN[op]

        def f(a, b, sa, za, sb, zb, so, zo):
            def g(*i):
                ra = _te_dequantize_value(idx(a, i), _pval(sa, i, 0), _pval(za, i, 0))
                rb = _te_dequantize_value(idx(b, i), _pval(sb, i, 0), _pval(zb, i, 0))
                v = _te_quantize_value(fn(ra, rb), _pval(so, i, 0), _pval(zo, i, 0), qmin, qmax)
                return v.astype(out_dtype)

            return te.compute(out_shape, g, name=op.replace(".", "_"))

        args = [a, b, s_a, z_a, s_b, z_b, s_o, z_o]
        return bb.call_te(
            f, *[_scalar_or_tensor(bb, x) for x in args], primfunc_name_hint=op.replace(".", "_")
        )

    vals = [_const_value(x) for x in (s_a, s_b, s_o)]
    names = ("lhs_scale", "rhs_scale", "output_scale")
    for name, v, e in zip(names, vals, (s_a, s_b, s_o), strict=True):
        if v is None:
            _fail(
                op,
                name,
                "a constant for integer rounding modes (use rounding='float' for runtime scales)",
                f"a non-constant {type(e).__name__}",
            )
    kind = op.split(".")[1]
    ma, mb, shift = P.elementwise_multipliers(kind, *vals)
    mode = {"tflite": "half_away", "tflite_single": "half_up"}.get(rounding, rounding)

    def f(a, b, za, zb, zo):
        def g(*i):
            da = idx(a, i).astype("int64") - _pval(za, i, 0).astype("int64")
            db = idx(b, i).astype("int64") - _pval(zb, i, 0).astype("int64")
            if kind == "multiply":
                acc = da * db * tirx.const(int(ma), "int64")
            else:
                sign = 1 if kind == "add" else -1
                acc = da * tirx.const(int(ma), "int64") + db * tirx.const(sign * int(mb), "int64")
            y = _te_rshift_round(acc, tirx.const(int(shift), "int64"), mode) + _pval(
                zo, i, 0
            ).astype("int64")
            return te.max(te.min(y, tirx.const(qmax, "int64")), tirx.const(qmin, "int64")).astype(
                out_dtype
            )

        return te.compute(out_shape, g, name=op.replace(".", "_"))

    args = [a, b, z_a, z_b, z_o]
    return bb.call_te(
        f, *[_scalar_or_tensor(bb, x) for x in args], primfunc_name_hint=op.replace(".", "_")
    )


for _name in ("add", "subtract", "multiply"):
    _register(
        _name,
        f"Quantized elementwise {_name} with its own output scale/zero point (per-tensor).",
        _infer_elementwise,
        _legalize_elementwise,
    )
