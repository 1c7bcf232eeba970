"""``qnn.dynamic_quantize``: quantize a float32 tensor with qparams computed from the tensor
itself at run time (min/max over the tensor or over each row of the last axis).

It returns a tuple ``(q, scale, zero_point)``; the scale and zero point are 0-d
(``granularity="tensor"``) or of shape ``data.shape[:-1] + [1]`` (``"token"``), so they
broadcast against the data and against a ``qnn.dense`` accumulator. The arithmetic is
:func:`autoq.qnn.runtime_qparams.dynamic_quantize`, bit for bit; the legalization is one
PrimFunc (two reductions, the qparams, the quantize).
"""

from __future__ import annotations

from tvm import relax, te, tirx

from autoq import primitives as P
from autoq.qnn.checks import attr, check_dtype, check_out_dtype, dims, fail, tensor_type
from autoq.qnn.registration import make_call, register
from autoq.qnn.tensor_exprs import quantize_value

__all__ = [
    "GRANULARITIES",
    "dynamic_quantize",
    "qparam_range",
    "runtime_qparam_dims",
    "runtime_scale",
    "runtime_zero_point",
]

GRANULARITIES = ("tensor", "token")
_OUT_DTYPES = ("int8", "uint8")


def dynamic_quantize(
    data,
    granularity: str = "tensor",
    out_dtype: str = "int8",
    symmetric: bool = False,
    narrow_range: bool = False,
    reduce_range: bool = False,
) -> relax.Call:
    """``(q, scale, zero_point)``: ``data`` quantized with its own run-time qparams.

    ``granularity``: ``"tensor"`` (one scale) or ``"token"`` (one per row of the last axis).
    ``narrow_range`` / ``reduce_range`` shrink the integer range as in
    :func:`autoq.primitives.qrange` (the output dtype stays ``out_dtype``).
    """
    attrs = {
        "granularity": granularity,
        "out_dtype": out_dtype,
        "symmetric": bool(symmetric),
        "narrow_range": bool(narrow_range),
        "reduce_range": bool(reduce_range),
    }
    return make_call("qnn.dynamic_quantize", [data], attrs)


def runtime_qparam_dims(data_dims, granularity: str):
    """Dims of the run-time scale / zero point for data of ``data_dims`` (None: unknown)."""
    if granularity == "tensor":
        return []
    return None if data_dims is None else [*data_dims[:-1], 1]


def _infer(op, call):
    (data,) = call.args
    check_dtype(op, "data", data, ["float32"])
    out_dtype = attr(call, "out_dtype")
    check_out_dtype(op, out_dtype, _OUT_DTYPES)
    gran = attr(call, "granularity")
    if gran not in GRANULARITIES:
        fail(op, "granularity", "one of " + ", ".join(GRANULARITIES), repr(gran))
    d = dims(data)
    if gran == "token" and d is not None and len(d) == 0:
        fail(op, "data", "of rank >= 1 for granularity 'token'", "a 0-d tensor")
    pd = runtime_qparam_dims(d, gran)
    return relax.TupleType(
        [tensor_type(d, out_dtype), tensor_type(pd, "float32"), tensor_type(pd, "int32")]
    )


def _reduce(x, per_token: bool, reducer, name: str):
    """min or max over the last axis (keepdims) or over everything (0-d)."""
    shape = list(x.shape)
    if per_token:
        k = te.reduce_axis((0, shape[-1]), name="k")
        return te.compute([*shape[:-1], 1], lambda *i: reducer(x[(*i[:-1], k)], axis=k), name=name)
    ks = [te.reduce_axis((0, d), name=f"k{j}") for j, d in enumerate(shape)]
    return te.compute((), lambda: reducer(x[tuple(ks)], axis=ks), name=name)


def runtime_scale(lo, hi, qmin: int, qmax: int, symmetric: bool):
    """The float32 scale (a PrimExpr) from the reduced min ``lo`` and max ``hi``
    (runtime_qparams, same order); shared with the CPU kernel
    (:mod:`autoq.cpu.dynamic_quantize`)."""
    f32 = "float32"
    zero, one = tirx.const(0.0, f32), tirx.const(1.0, f32)
    tiny = tirx.const(1.1754943508222875e-38, f32)
    rmin, rmax = te.min(lo, zero), te.max(hi, zero)
    if symmetric:
        s = te.max(-rmin, rmax) / tirx.const((qmax - qmin) / 2, f32)
    else:
        s = (rmax - rmin) / tirx.const(float(qmax - qmin), f32)
    return tirx.Select(s < tiny, one, s)


def runtime_zero_point(lo, scale, qmin: int, qmax: int, symmetric: bool):
    """The int32 zero point (a PrimExpr) from the reduced min ``lo`` and the ``scale``."""
    f32 = "float32"
    if symmetric:
        return tirx.const((qmin + qmax + 1) // 2, "int32")
    rmin = te.min(lo, tirx.const(0.0, f32))
    z = tirx.const(float(qmin), f32) - te.round(rmin / scale)
    z = te.max(te.min(z, tirx.const(float(qmax), f32)), tirx.const(float(qmin), f32))
    return z.astype("int32")


def qparam_range(call) -> tuple[int, int]:
    """``(qmin, qmax)`` of the run-time qparams of the ``qnn.dynamic_quantize`` ``call``."""
    return P.qrange(
        attr(call, "out_dtype"), bool(attr(call, "narrow_range")), bool(attr(call, "reduce_range"))
    )


def _qparams(lo, hi, qmin: int, qmax: int, symmetric: bool):
    """TE scale and zero point tensors from the reduced min/max."""
    scale = te.compute(
        lo.shape, lambda *i: runtime_scale(lo[i], hi[i], qmin, qmax, symmetric), name="scale"
    )
    zp = te.compute(
        lo.shape,
        lambda *i: runtime_zero_point(lo[i], scale[i], qmin, qmax, symmetric),
        name="zero_point",
    )
    return scale, zp


def _legalize(bb, call):
    out_dtype = attr(call, "out_dtype")
    per_token = attr(call, "granularity") == "token"
    qmin, qmax = qparam_range(call)
    symmetric = bool(attr(call, "symmetric"))

    def f(x):
        lo = _reduce(x, per_token, te.min, "rmin")
        hi = _reduce(x, per_token, te.max, "rmax")
        s, z = _qparams(lo, hi, qmin, qmax, symmetric)

        def q_at(*i):
            j = (*i[:-1], 0) if per_token else ()
            v = quantize_value(x[i], s[j], z[j], *P.qrange(out_dtype))
            return v.astype(out_dtype)

        return [te.compute(x.shape, q_at, name="quantize"), s, z]

    return bb.call_te(f, call.args[0], primfunc_name_hint="qnn_dynamic_quantize")


register(dynamic_quantize, _infer, _legalize)
