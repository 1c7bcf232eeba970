"""One rule per ``qnn.*`` op of the realized module (:data:`RULES`): the ONNX QDQ form of it.

* ``quantize`` / ``dequantize`` / ``requantize``: ``QuantizeLinear`` / ``DequantizeLinear``
  with autoq's scales and zero points (per-axis ones keep their axis); an int32
  ``requantize`` (a residual onto an accumulator's grid) is the real value of its input.
* ``conv2d`` / ``dense`` / ``matmul`` / ``sum``: the float op (``ReduceMean`` for ``sum``)
  on ``DequantizeLinear`` of its integer operands (int8 weight initializers, per output
  channel), giving the accumulator's real value (:class:`~autoq.export.graph.Acc`); the
  int32 bias that follows becomes the Conv / Gemm bias input (``DequantizeLinear`` of an
  int32 initializer, scale ``s_x * s_w``). A Conv input on an int8 grid (a per-axis one)
  is read as uint8 ``q + 128`` (:meth:`~autoq.export.writer.Writer.shifted`), for OpenVINO.
* ``add`` / ``subtract`` / ``multiply``: DQ, the float op, Q.
* ``lut``: exact: ``Gather`` of the 256-entry table initializer at ``int32(q) - qmin`` (per
  channel: the tables flattened, each channel's offset added).
* ``dynamic_quantize`` (per token or per tensor): the run-time qparams computed with float
  ops in the order of :mod:`autoq.qnn.runtime_qparams` (``ReduceMin`` / ``ReduceMax``,
  ``Div``, ``Round``, ``Clip``): the same integers; the dense layer reading them multiplies
  ``q - zp`` by the integer weights (int8 initializers ``Cast`` to float), an exact integer
  accumulator in float32, like autoq's.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from autoq import primitives as P
from autoq.ir.toolkit import const_array, shape_of

from .graph import Acc, Float, Int
from .writer import SHIFT, attr, broadcast_along

__all__ = ["RULES"]

_F32 = np.float32
_FLOAT = TensorProto.FLOAT


def _rank(expr) -> int:
    return len(shape_of(expr))


def _product(a, b) -> np.ndarray:
    """``s_x * s_w`` in float32 (the accumulator's scale), flattened to 1-D (or 0-d)."""
    prod = (np.asarray(a, _F32).reshape(-1) * np.asarray(b, _F32).reshape(-1)).astype(_F32)
    return prod.reshape(()) if prod.size == 1 else prod


def _integer(w, expr, what: str) -> Int:
    value = w.value(expr)
    if not isinstance(value, Int):
        raise w.error(f"{what} is not an integer tensor")
    return value


def _real_of(w, call, index: int, qindex: int, axis: int, rank: int) -> str:
    """The real value of the quantized argument ``index`` whose scale and zero point are the
    arguments ``qindex``, ``qindex + 1``."""
    value = w.value(call.args[index])
    scale = w.array(call.args[qindex], "a scale")
    if isinstance(value, Acc):
        return w.rescale(value, scale, axis)
    zero_point = w.array(call.args[qindex + 1], "a zero point")
    return w.dq(value, scale, zero_point, axis, rank)


def quantize(w, call, var):
    rank = _rank(var)
    x = w.real(w.value(call.args[0]), "the input of qnn.quantize")
    scale = w.array(call.args[1], "the scale of qnn.quantize")
    zp = w.array(call.args[2], "the zero point of qnn.quantize")
    return w.q(x, scale, zp, attr(call, "out_dtype"), attr(call, "axis", -1), rank)


def dequantize(w, call, var):
    return Float(_real_of(w, call, 0, 1, attr(call, "axis", -1) % _rank(var), _rank(var)))


def requantize(w, call, var):
    rank, axis = _rank(var), attr(call, "axis", -1) % _rank(var)
    real = _real_of(w, call, 0, 1, axis, rank)
    scale = w.array(call.args[3], "the output scale of qnn.requantize")
    zp = w.array(call.args[4], "the output zero point of qnn.requantize")
    dtype = attr(call, "out_dtype")
    if dtype == "int32":
        if np.any(zp != 0):
            raise w.error("an int32 requantize with a non-zero output zero point")
        return Acc(real, _flat(scale), axis, rank)
    return w.q(real, scale, zp, dtype, axis, rank)


def _flat(scale) -> np.ndarray:
    scale = np.asarray(scale, _F32)
    return scale.reshape(()) if scale.size == 1 else scale.reshape(-1)


def conv2d(w, call, var):
    if attr(call, "data_layout") != "NCHW" or attr(call, "kernel_layout") != "OIHW":
        raise w.error("qnn.conv2d in a layout other than NCHW / OIHW")
    x = _integer(w, call.args[0], "the conv input")
    # OpenVINO 2026.4 has no conv kernel for an int8 input with a nonzero (or per-channel)
    # zero point ("No suitable implementations"); a uint8 one it runs
    x = w.shifted(x)
    per_channel = np.asarray(w.array(call.args[2], "a scale")).size > 1
    x = w.dq(x, *_qp(w, call, 2), axis=1, rank=4)
    weight = _integer(w, call.args[1], "the conv weight")
    wq = w.dq(weight, *_qp(w, call, 4), axis=0, rank=4)
    pads = attr(call, "padding")
    if len(pads) == 2:
        pads = [pads[0], pads[1], pads[0], pads[1]]
    out = w.g.node(
        "Conv", [x, wq], hint=var.name, share=False, strides=attr(call, "strides"),
        pads=pads, dilations=attr(call, "dilation"), group=attr(call, "groups"),
    )  # fmt: skip
    if per_channel:
        w.int8_outputs.add(out)
    scale = _product(w.array(call.args[2], "scale"), w.array(call.args[4], "scale"))
    return Acc(out, scale, 1, 4, bias_node=w.g.nodes[-1])


def _qp(w, call, index: int):
    return (
        w.array(call.args[index], "a scale"),
        w.array(call.args[index + 1], "a zero point"),
    )


def dense(w, call, var):
    rank = _rank(var)
    x = _integer(w, call.args[0], "the dense input")
    weight = w.array(call.args[1], "the dense weight")  # [N, K]
    w_scale, w_zp = _qp(w, call, 4)
    if const_array(call.args[2]) is None:
        return _dynamic_dense(w, call, var, x, weight, w_zp)
    xr = w.dq(x, *_qp(w, call, 2), axis=-1, rank=rank)
    scale = _product(w.array(call.args[2], "scale"), w_scale)
    if rank == 2:
        wq = w.dq(Int(w.g.const(weight, hint="weight"), str(weight.dtype)), w_scale, w_zp, 0, 2)
        out = w.g.node("Gemm", [xr, wq], hint=var.name, share=False, transB=1)
        return Acc(out, scale, 1, 2, bias_node=w.g.nodes[-1])
    wt = Int(w.g.const(weight.T, hint="weight"), str(weight.dtype))
    out = w.g.node("MatMul", [xr, w.dq(wt, w_scale, w_zp, 1, 2)], hint=var.name)
    return Acc(out, scale, rank - 1, rank)


def _dynamic_dense(w, call, var, x, weight, w_zp):
    """``(q - zp) @ (W - zp_w).T`` exactly (integer values in float32, like autoq's). The
    weights are ``Cast`` from int8 (not dequantized: ONNX Runtime would fuse a
    ``DequantizeLinear`` weight into its own per-tensor dynamic quantization)."""
    zp = w.value(call.args[3])
    xi = w.unshifted(x, "float32")
    zf = w.g.node("Cast", [zp.name], hint="zp_float", to=_FLOAT)
    centered = w.g.node("Sub", [xi, zf], hint="centered")
    wt = w.g.node("Cast", [w.g.const(weight.T, hint="weight")], hint="weight_int", to=_FLOAT)
    w_zp = np.asarray(w_zp).reshape(-1)
    if np.any(w_zp != 0):
        wt = w.g.node("Sub", [wt, w.g.const(np.broadcast_to(w_zp, weight.shape[:1]), _F32)])
    out = w.g.node("MatMul", [centered, wt], hint=var.name)
    return Acc(out, np.ones((), _F32), 0, _rank(var))


def matmul(w, call, var):
    a = w.dq(_integer(w, call.args[0], "lhs"), *_qp(w, call, 2))
    b = w.dq(_integer(w, call.args[1], "rhs"), *_qp(w, call, 4))
    scale = _product(w.array(call.args[2], "scale"), w.array(call.args[4], "scale"))
    return Acc(w.g.node("MatMul", [a, b], hint=var.name), scale, 0, _rank(var))


def qsum(w, call, var):
    """``ReduceMean`` of the dequantized input, on the grid ``scale / N`` (``N`` elements
    summed): the same integers as autoq's sum, and the form OpenVINO reads correctly
    (OpenVINO 2026.4 computes ``ReduceSum`` of a requantized tensor with a nonzero zero
    point wrongly; ``ReduceMean`` of it is right, and a mean's rescale becomes a no-op)."""
    x = w.dq(_integer(w, call.args[0], "the input of qnn.sum"), *_qp(w, call, 1))
    shape = shape_of(call.args[0])
    axes = [a % len(shape) for a in attr(call, "axis")]
    count = int(np.prod([shape[a] for a in axes]))
    keep = int(attr(call, "keepdims"))
    out = w.g.node("ReduceMean", [x, w.ints(axes, hint="axes")], hint=var.name, keepdims=keep)
    scale = (_flat(w.array(call.args[1], "scale")) / _F32(count)).astype(_F32)
    return Acc(out, scale, 0, _rank(var))


def _elementwise(onnx_op: str):
    def rule(w, call, var):
        rank = _rank(var)
        axis = attr(call, "axis", -1)
        axis = -1 if axis is None else axis % rank
        a = _real_of(w, call, 0, 2, axis, rank)
        b = _real_of(w, call, 1, 4, axis, rank)
        out = w.g.node(onnx_op, [a, b], hint=var.name)
        scale, zp = _qp(w, call, 6)
        return w.q(out, scale, zp, attr(call, "out_dtype"), axis, rank)

    return rule


def lut(w, call, var):
    x = _integer(w, call.args[0], "the input of qnn.lut")
    table = w.array(call.args[1], "the table of qnn.lut")
    qmin = int(np.iinfo(np.dtype(x.dtype)).min) + x.shift  # the ONNX integer of qmin
    axis = attr(call, "axis")
    if axis is None:
        offset = np.asarray(-qmin, np.int32)
    else:
        rank = _rank(var)
        offset = broadcast_along(np.arange(table.shape[0]) * table.shape[1] - qmin, axis, rank)
        offset = offset.astype(np.int32)
    index = w.g.node("Cast", [x.name], hint="index", to=TensorProto.INT32)
    index = w.g.node("Add", [index, w.g.const(offset, hint="lut_offset")], hint="index")
    out = Int("", str(table.dtype), SHIFT if table.dtype == np.int8 else 0)
    tab = w.g.const((table.reshape(-1).astype(np.int32) + out.shift).astype(out.onnx_dtype))
    return Int(w.g.node("Gather", [tab, index], hint=var.name, axis=0), out.dtype, out.shift)


def dynamic_quantize(w, call, var):
    g = w.g
    x = w.real(w.value(call.args[0]), "the input of qnn.dynamic_quantize")
    dtype = attr(call, "out_dtype")
    symmetric = bool(attr(call, "symmetric"))
    qmin, qmax = P.qrange(dtype, bool(attr(call, "narrow_range")), bool(attr(call, "reduce_range")))

    def c(v):
        return g.const(np.asarray(v, _F32), hint="c")

    if attr(call, "granularity") == "token":
        axes = [w.ints([-1], hint="axes")]
        keep = 1
    else:
        axes, keep = [], 0
    rmin = g.node("Min", [g.node("ReduceMin", [x, *axes], keepdims=keep), c(0)], hint="rmin")
    rmax = g.node("Max", [g.node("ReduceMax", [x, *axes], keepdims=keep), c(0)], hint="rmax")
    if symmetric:
        span = g.node("Max", [g.node("Neg", [rmin]), rmax])
        scale = g.node("Div", [span, c(_F32((qmax - qmin) / 2))])
    else:
        scale = g.node("Div", [g.node("Sub", [rmax, rmin]), c(_F32(qmax - qmin))])
    tiny = g.node("Less", [scale, c(np.finfo(_F32).tiny)])
    scale = g.node("Where", [tiny, c(1), scale], hint=f"{var.name}_scale")
    if symmetric:
        zpf = c((qmin + qmax + 1) // 2)
    else:
        shifted = g.node("Sub", [c(qmin), g.node("Round", [g.node("Div", [rmin, scale])])])
        zpf = g.node("Clip", [shifted, c(qmin), c(qmax)])
    zp = g.node("Cast", [zpf], hint=f"{var.name}_zero_point", to=TensorProto.INT32)
    lo, hi = P.qrange(dtype)
    q = g.node("Add", [g.node("Round", [g.node("Div", [x, scale])]), zpf])
    q = g.node("Clip", [q, c(lo), c(hi)])
    elem = TensorProto.INT8 if dtype == "int8" else TensorProto.UINT8
    q = g.node("Cast", [q], hint=f"{var.name}_q", to=elem)
    return (Int(q, dtype), Float(scale), Int(zp, "int32"))


#: qnn op -> rule(writer, call, var) -> the binding's value in the ONNX graph
RULES = {
    "qnn.quantize": quantize,
    "qnn.dequantize": dequantize,
    "qnn.requantize": requantize,
    "qnn.conv2d": conv2d,
    "qnn.dense": dense,
    "qnn.matmul": matmul,
    "qnn.sum": qsum,
    "qnn.add": _elementwise("Add"),
    "qnn.subtract": _elementwise("Sub"),
    "qnn.multiply": _elementwise("Mul"),
    "qnn.lut": lut,
    "qnn.dynamic_quantize": dynamic_quantize,
}
