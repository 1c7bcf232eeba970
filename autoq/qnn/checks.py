"""What type inference of every ``qnn.*`` op shares: the dtype conventions, reading a call's
arguments and attributes, and the argument checks that raise :class:`QnnError` naming the
op, the argument and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tvm
from tvm import relax, tirx
from tvm_ffi import register_error

from autoq import primitives as P
from autoq.ir.toolkit import const_array

__all__ = [
    "ACC_DTYPE",
    "ACC_INPUT_DTYPES",
    "QDTYPES",
    "QnnError",
    "attr",
    "broadcast_dims",
    "check_dtype",
    "check_out_dtype",
    "check_qparams",
    "check_rounding",
    "check_scalar",
    "dims",
    "fail",
    "static_int",
    "tensor_type",
    "type_of",
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


# ----------------------------------------------------------------------------- reading


def type_of(expr) -> relax.TensorType:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType):
        raise QnnError(f"expected a tensor, got {ty}")
    return ty


def dims(expr):
    """Static or symbolic dims of a tensor expression, or None if the rank is unknown."""
    ty = type_of(expr)
    if ty.shape is None:
        return None
    return list(ty.shape.values)


def static_int(d):
    """A dimension as a Python int, or None when it is symbolic."""
    return int(d) if isinstance(d, int | tirx.IntImm) else None


def attr(call, name, default=None):
    """A call attribute as a Python value (ints and lists of ints unwrapped)."""
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


def tensor_type(shape, dtype) -> relax.TensorType:
    """The result type: ``shape`` (a list of dims, or None for an unknown rank) and dtype."""
    if shape is None:
        return relax.TensorType(dtype=dtype, ndim=-1)
    return relax.TensorType(shape, dtype)


def broadcast_dims(op, a, b):
    """numpy broadcasting of two dim lists (None when a rank is unknown)."""
    if a is None or b is None:
        return None
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        xi, yi = static_int(x), static_int(y)
        if xi == 1:
            out.append(y)
        elif yi == 1 or (xi is not None and xi == yi):
            out.append(x)
        elif xi is not None and yi is not None:
            raise QnnError(f"{op}: shapes {a} and {b} do not broadcast")
        else:
            out.append(x)
    return out[::-1]


# ---------------------------------------------------------------------------- checking


def fail(op: str, arg: str, expected: str, got) -> None:
    if isinstance(got, list | tuple | tvm.ir.Array):  # shapes: [3, 4], not [T.int64(3), ...]
        got = [static_int(d) if static_int(d) is not None else d for d in got]
    raise QnnError(f"{op}: argument '{arg}' must be {expected}, got {got}")


def check_dtype(op: str, arg: str, expr, allowed: Sequence[str]) -> str:
    dtype = str(type_of(expr).dtype)
    if dtype not in allowed:
        fail(op, arg, "of dtype " + " or ".join(allowed), dtype)
    return dtype


def check_out_dtype(op: str, dtype, allowed: Sequence[str]) -> None:
    if dtype not in allowed:
        fail(op, "out_dtype", "one of " + ", ".join(allowed), dtype)


def check_rounding(op: str, rounding) -> None:
    if rounding not in P.ROUNDING_MODES:
        fail(op, "rounding", "one of " + ", ".join(P.ROUNDING_MODES), repr(rounding))


def check_scalar(op: str, arg: str, expr, why: str) -> None:
    """A per-tensor parameter: a scalar or a tensor of one element."""
    if type_of(expr).ndim not in (0, -1) and static_int(dims(expr)[0]) != 1:
        fail(op, arg, f"a scalar ({why})", dims(expr))


def check_qparams(
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
    check_dtype(op, sname, scale, ["float32"])
    check_dtype(op, zname, zero_point, ["int32"])
    for name, e in ((sname, scale), (zname, zero_point)):
        ndim = type_of(e).ndim
        if ndim not in (0, 1, -1):
            fail(op, name, "a scalar or a 1-D tensor", f"a {ndim}-D tensor")
    sdims, zdims = dims(scale), dims(zero_point)
    slen = static_int(sdims[0]) if sdims else 1
    zlen = static_int(zdims[0]) if zdims else 1
    if slen is not None and zlen is not None and slen != zlen and 1 not in (slen, zlen):
        fail(op, zname, f"of length {slen} like '{sname}' (or a scalar)", f"length {zlen}")
    _check_axis(op, ((sname, slen), (zname, zlen)), data_dims, axis)
    _check_values(op, sname, const_array(scale), zname, const_array(zero_point), qdtype)


def _check_axis(op: str, lengths, data_dims, axis: int | None) -> None:
    """Per-axis lengths ``((name, length), ...)`` against the data's ``axis`` dimension."""
    if data_dims is None or axis is None:
        return
    if len(data_dims) == 0:
        # 0-d data: any axis (the default is -1) is fine with per-tensor parameters
        for name, n in lengths:
            if n != 1:
                fail(op, name, "a scalar (the data is 0-d)", f"length {n}")
        return
    if all(n == 1 for _, n in lengths):
        # the axis only matters (and is only checked) for per-axis parameters: ONNX's
        # default axis=1 comes with per-tensor parameters on 1-D data, for example
        return
    ndim = len(data_dims)
    if not -ndim <= axis < ndim:
        fail(op, "axis", f"in [{-ndim}, {ndim})", axis)
    for name, n in lengths:
        if n is None or n == 1:
            continue
        d = static_int(data_dims[axis % ndim])
        if d is not None and d != n:
            fail(
                op, name, f"of length {d} (dimension {axis} of the data) or a scalar", f"length {n}"
            )


def _check_values(op: str, sname: str, s, zname: str, z, qdtype: str | None) -> None:
    """Constant scales must be positive and finite, constant zero points inside the range."""
    if s is not None and not (np.all(np.isfinite(s)) and np.all(s > 0)):
        bad = s[~(np.isfinite(s) & (s > 0))]
        fail(op, sname, "positive and finite", f"{bad.ravel()[:4].tolist()}")
    if z is not None and qdtype is not None:
        lo, hi = P.qrange(qdtype)
        if np.any(z < lo) or np.any(z > hi):
            bad = z[(z < lo) | (z > hi)]
            fail(
                op, zname, f"inside the {qdtype} range [{lo}, {hi}]", f"{bad.ravel()[:4].tolist()}"
            )
