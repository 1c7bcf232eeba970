"""One rule per Relax op of the realized module (:data:`RULES`): the integer data movement
between quantized layers (relu / clip as ``Max`` / ``Min`` on int8, pools, reshapes,
transposes, slices, concatenation) and the float ops of fp32 layers (softmax, layer norm,
GELU, elementwise arithmetic, ...), each the ONNX op of the same meaning.

``add`` / ``subtract`` on accumulators (:class:`~autoq.export.graph.Acc`): an int32 bias
constant becomes the input ``B`` of the Conv / Gemm that computed the accumulator
(``DequantizeLinear`` of the int32 bias with scale ``s_x * s_w``, the form ONNX Runtime fuses
into ``QLinearConv``), or an ``Add`` of the bias' real value; two accumulators add on the
first one's grid.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from autoq.errors import ExportError
from autoq.ir.toolkit import const_array, shape_of

from .graph import Acc, Float, Int
from .writer import attr, broadcast_along

__all__ = ["RULES"]

_F32 = np.float32


def _same_kind(w, values, names):
    """The ONNX names of operands that are all integers (in one representation) or all
    floats, and that kind."""
    if all(isinstance(v, Int) for v in values):
        if len({v.shift for v in values}) > 1:
            raise w.error("integer operands in different representations")
        return values[0], names
    if all(isinstance(v, Float) for v in values):
        return values[0], names
    raise w.error("an op mixes integer and float operands")


def _binary(onnx_op: str):
    def rule(w, call, var):
        a, b = (w.value(arg) for arg in call.args[:2])
        if isinstance(a, Acc) or isinstance(b, Acc):
            return _accumulate(w, call, var, onnx_op, a, b)
        names = [a.name, b.name]
        shifted = [v for v in (a, b) if isinstance(v, Int) and v.shift]
        if shifted:  # int8 as uint8: an integer constant moves with it (Max / Min only)
            if onnx_op not in ("Max", "Min"):
                raise w.error(f"'{onnx_op}' on int8 activations")
            for k, arg in enumerate(call.args[:2]):
                arr = const_array(arg)
                if arr is not None:
                    names[k] = w.shifted_const(arr, shifted[0])
            a = b = shifted[0]  # both operands are now in its representation
        kind, names = _same_kind(w, [a, b], names)
        out = w.g.node(onnx_op, names, hint=var.name)
        return _like(kind, out)

    return rule


def _accumulate(w, call, var, onnx_op, a, b):
    if onnx_op not in ("Add", "Sub"):
        raise w.error(f"an int32 accumulator goes to '{onnx_op}'")
    first, second = call.args[0], call.args[1]
    if not isinstance(a, Acc):
        if onnx_op == "Sub":
            raise w.error("an accumulator subtracted from a tensor")
        a, b, first, second = b, a, second, first
    if isinstance(b, Acc):
        out = w.g.node(onnx_op, [a.name, w.rescale(b, a.scale, a.axis)], hint=var.name)
        return Acc(out, a.scale, a.axis, a.rank)
    bias = const_array(second)
    if bias is None or not isinstance(b, Int):
        raise w.error("an accumulator plus a tensor that is not an integer constant")
    if onnx_op == "Add" and _fuses(w, a, bias, first):
        _fuse_bias(w, a, bias)
        return Acc(a.name, a.scale, a.axis, a.rank)
    scale = broadcast_along(a.scale, a.axis, a.rank)
    real = (bias.astype(_F32) * scale).astype(_F32)
    out = w.g.node(onnx_op, [a.name, w.g.const(real, hint="bias")], hint=var.name)
    return Acc(out, a.scale, a.axis, a.rank)


def _fuses(w, acc: Acc, bias: np.ndarray, acc_expr) -> bool:
    """Whether ``bias`` can be the ``B`` input of the Conv / Gemm that computed ``acc``: one
    int32 per output channel, and nothing else reads the accumulator without it."""
    node = acc.bias_node
    if node is None or len(node.input) != 2 or not w.single_use(acc_expr):
        return False
    if bias.dtype != np.int32 or bias.ndim > acc.rank:
        return False
    want = [1] * acc.rank
    want[acc.axis] = shape_of(acc_expr)[acc.axis]
    return [1] * (acc.rank - bias.ndim) + list(bias.shape) == want


def _fuse_bias(w, acc: Acc, bias: np.ndarray) -> None:
    n = bias.size
    scale = np.broadcast_to(np.asarray(acc.scale, _F32).reshape(-1), (n,))
    zero = np.zeros(n, np.int32)
    b = w.dq(Int(w.g.const(bias.reshape(-1), hint="bias"), "int32"), scale, zero, 0, 1)
    acc.bias_node.input.append(b)


def _compare(onnx_op: str):
    """Comparisons and logical ops (attention masks): a bool tensor."""

    def rule(w, call, var):
        a, b = (w.value(arg) for arg in call.args[:2])
        if any(isinstance(v, Acc) or (isinstance(v, Int) and v.shift) for v in (a, b)):
            raise w.error(f"'{onnx_op}' on quantized operands")
        return Int(w.g.node(onnx_op, [a.name, b.name], hint=var.name), "bool")

    return rule


def static_shape(w, call, var):
    """``shape_of`` a static shape: the ints themselves (``shape_to_tensor`` makes them a
    constant)."""
    shape = shape_of(call.args[0])
    if shape is None:
        raise w.error("shape_of a tensor without a static shape")
    return shape


def shape_to_tensor(w, call, var):
    shape = w.values.get(call.args[0])
    if not isinstance(shape, tuple) or not all(isinstance(d, int) for d in shape):
        raise w.error("shape_to_tensor of a shape that is not static")
    return Int(w.ints(shape), "int64")


def broadcast_to(w, call, var):
    x = w.value(call.args[0])
    return _like(x, w.g.node("Expand", [x.name, w.ints(shape_of(var))], hint=var.name))


def _unary(onnx_op: str, **attrs):
    def rule(w, call, var):
        x = w.value(call.args[0])
        if isinstance(x, Int) and x.shift:
            raise w.error(f"'{onnx_op}' on int8 activations")
        out = w.g.node(onnx_op, [x.name], hint=var.name, **attrs)
        return _like(x, out)

    return rule


def _float_unary(build):
    def rule(w, call, var):
        x = w.real(w.value(call.args[0]), f"the input of '{var.name}'")
        return Float(build(w.g, x, var.name))

    return rule


def astype(w, call, var):
    x = w.value(call.args[0])
    dtype = attr(call, "dtype")
    if isinstance(x, Acc):
        if dtype != "float32":
            raise w.error(f"an accumulator cast to {dtype}")
        return Float(w.rescale(x, np.ones((), _F32), 0))
    if isinstance(x, Int):
        out = w.unshifted(x, dtype)
    else:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        out = w.g.node("Cast", [x.name], hint=var.name, to=elem)
    return Float(out) if dtype == "float32" else Int(out, dtype)


def _reshape(w, call, var):
    x = w.value(call.args[0])
    shape = w.ints(shape_of(var))
    out = w.g.node("Reshape", [x.name, shape], hint=var.name)
    return _like(x, out)


def _like(x, name: str):
    """The value of a data-movement op's output: the input's kind (an accumulator keeps its
    per-tensor scale; a per-channel one would need its axis moved)."""
    if isinstance(x, Int):
        return Int(name, x.dtype, x.shift)
    if isinstance(x, Float):
        return Float(name)
    if isinstance(x, Acc) and np.asarray(x.scale).size == 1:
        return Acc(name, x.scale, 0, x.rank)
    raise ExportError(
        f"ONNX export: a data-movement op on '{name}' reads a per-channel int32 accumulator; "
        "use the TVM library (--format so) for this model"
    )


def permute_dims(w, call, var):
    x = w.value(call.args[0])
    axes = attr(call, "axes")
    rank = len(shape_of(var))
    perm = list(range(rank))[::-1] if axes is None else [a % rank for a in axes]
    return _like(x, w.g.node("Transpose", [x.name], hint=var.name, perm=perm))


def clip(w, call, var):
    x = w.value(call.args[0])
    lo, hi = (float(call.args[i].value) for i in (1, 2))
    if isinstance(x, Int):
        info = np.iinfo(np.dtype(x.dtype))
        lo, hi = (np.clip(np.asarray(v), info.min, info.max) for v in (lo, hi))
        bounds = [w.shifted_const(np.asarray(v).astype(np.int64), x) for v in (lo, hi)]
    else:
        bounds = [w.g.const(np.asarray(v, _F32), hint="bound") for v in (lo, hi)]
    return _like(x, w.g.node("Clip", [x.name, *bounds], hint=var.name))


def softmax(w, call, var):
    x = w.real(w.value(call.args[0]), "the softmax input")
    return Float(w.g.node("Softmax", [x], hint=var.name, axis=attr(call, "axis")))


def layer_norm(w, call, var):
    x = w.real(w.value(call.args[0]), "the layer norm input")
    rank = len(shape_of(var))
    axes = sorted(a % rank for a in attr(call, "axes"))
    if axes != list(range(axes[0], rank)):
        raise w.error("a layer norm over axes that are not the trailing ones")
    gamma, beta = (w.value(a).name for a in call.args[1:3])
    out = w.g.node(
        "LayerNormalization", [x, gamma, beta], hint=var.name, axis=axes[0],
        epsilon=attr(call, "epsilon"),
    )  # fmt: skip
    return Float(out)


def _pool_attrs(w, call):
    if attr(call, "layout") != "NCHW":
        raise w.error("a pool in a layout other than NCHW")
    return {
        "kernel_shape": attr(call, "pool_size"),
        "strides": attr(call, "strides"),
        "pads": attr(call, "padding"),
        "dilations": attr(call, "dilation"),
        "ceil_mode": int(attr(call, "ceil_mode")),
    }


def max_pool2d(w, call, var):
    x = w.value(call.args[0])
    out = w.g.node("MaxPool", [x.name], hint=var.name, **_pool_attrs(w, call))
    return _like(x, out)


def avg_pool2d(w, call, var):
    x = w.real(w.value(call.args[0]), "the average pool input")
    attrs = _pool_attrs(w, call)
    attrs["count_include_pad"] = int(attr(call, "count_include_pad"))
    return Float(w.g.node("AveragePool", [x], hint=var.name, **attrs))


def adaptive_avg_pool2d(w, call, var):
    x = w.real(w.value(call.args[0]), "the average pool input")
    if list(shape_of(var)[2:]) != [1, 1]:
        raise w.error("an adaptive average pool to a size other than 1x1")
    return Float(w.g.node("GlobalAveragePool", [x], hint=var.name))


def _onnx_pads(call) -> list:
    """A conv's ``padding`` as ONNX ``pads`` (begin H, W, end H, W; Relax may give 2)."""
    pads = list(attr(call, "padding"))
    return pads * 2 if len(pads) == 2 else pads


def conv2d(w, call, var):
    if attr(call, "data_layout") != "NCHW" or attr(call, "kernel_layout") != "OIHW":
        raise w.error("conv2d in a layout other than NCHW / OIHW")
    x, weight = (w.real(w.value(a), "a conv operand") for a in call.args[:2])
    pads = _onnx_pads(call)
    out = w.g.node(
        "Conv", [x, weight], hint=var.name, strides=attr(call, "strides"), pads=pads,
        dilations=attr(call, "dilation"), group=attr(call, "groups"),
    )  # fmt: skip
    return Float(out)


def conv2d_transpose(w, call, var):
    if attr(call, "data_layout") != "NCHW" or attr(call, "kernel_layout") != "IOHW":
        raise w.error("conv2d_transpose in a layout other than NCHW / IOHW")
    x, weight = (w.real(w.value(a), "a transposed conv operand") for a in call.args[:2])
    pads = _onnx_pads(call)
    out = w.g.node(
        "ConvTranspose", [x, weight], hint=var.name, strides=attr(call, "strides"), pads=pads,
        output_padding=attr(call, "output_padding"), dilations=attr(call, "dilation"),
        group=attr(call, "groups"),
    )  # fmt: skip
    return Float(out)


#: Relax resize2d method -> ONNX Resize mode; rounding method -> nearest_mode
_RESIZE_MODES = {"nearest_neighbor": "nearest", "linear": "linear", "cubic": "cubic"}
_NEAREST = {"": "round_prefer_floor", "round": "round_prefer_ceil", "floor": "floor",
            "ceil": "ceil", "round_prefer_floor": "round_prefer_floor",
            "round_prefer_ceil": "round_prefer_ceil"}  # fmt: skip


def resize2d(w, call, var):
    """``image.resize2d`` as ``Resize`` to the output's size; nearest on an integer tensor
    stays integer (data movement), the other modes run on floats."""
    method = attr(call, "method")
    if attr(call, "layout") != "NCHW" or method not in _RESIZE_MODES:
        raise w.error(f"a resize2d in layout {attr(call, 'layout')} / method {method}")
    x = w.value(call.args[0])
    if isinstance(x, Int) and method != "nearest_neighbor":
        raise w.error("an integer tensor resized by interpolation")
    attrs = {
        "mode": _RESIZE_MODES[method],
        "coordinate_transformation_mode": attr(call, "coordinate_transformation_mode"),
    }
    if method == "nearest_neighbor":
        attrs["nearest_mode"] = _NEAREST.get(attr(call, "rounding_method") or "", "floor")
    if method == "cubic":
        attrs["cubic_coeff_a"] = float(attr(call, "cubic_alpha"))
        attrs["exclude_outside"] = int(attr(call, "cubic_exclude"))
    sizes = w.ints(shape_of(var), hint="sizes")
    return _like(x, w.g.node("Resize", [x.name, "", "", sizes], hint=var.name, **attrs))


def _reduce(onnx_op: str):
    def rule(w, call, var):
        x = w.real(w.value(call.args[0]), "a reduction input")
        axes = attr(call, "axis")
        inputs = [x] if axes is None else [x, w.ints(axes, hint="axes")]
        keep = int(bool(attr(call, "keepdims")))
        return Float(w.g.node(onnx_op, inputs, hint=var.name, keepdims=keep))

    return rule


def concat(w, call, var):
    values = w.value(call.args[0])
    kind, names = _same_kind(w, list(values), [v.name for v in values])
    axis = attr(call, "axis") % len(shape_of(var))
    return _like(kind, w.g.node("Concat", names, hint=var.name, axis=axis))


def split(w, call, var):
    x = w.value(call.args[0])
    rank = len(shape_of(call.args[0]))
    axis = attr(call, "axis") % rank
    sizes = [int(f.shape.values[axis]) for f in var.ty.fields]
    outs = w.g.node(
        "Split", [x.name, w.ints(sizes, hint="split")], hint=var.name, outputs=len(sizes),
        axis=axis,
    )  # fmt: skip
    outs = [outs] if isinstance(outs, str) else outs
    return tuple(_like(x, o) for o in outs)


def strided_slice(w, call, var):
    x = w.value(call.args[0])
    axes, begin, end = (_prims(call.args[i]) for i in (1, 2, 3))
    steps = _prims(call.args[4]) if len(call.args) > 4 else [1] * len(axes)
    inputs = [x.name, *(w.ints(v, hint="slice") for v in (begin, end, axes, steps))]
    return _like(x, w.g.node("Slice", inputs, hint=var.name))


def _prims(expr) -> list[int]:
    fields = expr.fields if hasattr(expr, "fields") else expr.values
    return [int(getattr(f, "value", f)) for f in fields]


def take(w, call, var):
    x, index = w.value(call.args[0]), w.value(call.args[1])
    axis = attr(call, "axis")
    out = w.g.node("Gather", [x.name, index.name], hint=var.name, axis=0 if axis is None else axis)
    return _like(x, out)


def call_tir(w, call, var):
    """A ``call_tir`` the ONNX importer emits for ``Pad`` (a constant or edge pad of one
    tensor): the pad widths, mode and value found by running the TIR function on a probe
    input and checked against ``numpy.pad``; any other TIR function is an error."""
    func = w.module[call.args[0]] if w.module is not None else None
    args = call.args[1].fields if hasattr(call.args[1], "fields") else [call.args[1]]
    shape_in = shape_of(args[0]) if len(args) == 1 else None
    pads = _probe_pad(func, shape_in, shape_of(var), str(var.ty.dtype)) if shape_in else None
    if pads is None:
        raise w.error(f"the TIR function '{call.args[0].name_hint}' is not a pad")
    widths, mode, value = pads
    x = w.value(args[0])
    inputs = [x.name, w.ints([b for b, _ in widths] + [a for _, a in widths], hint="pads")]
    if mode == "constant" and isinstance(x, Int):
        inputs.append(w.shifted_const(np.asarray(value), x))
    elif mode == "constant":
        inputs.append(w.g.const(np.asarray(value, _F32), hint="pad_value"))
    return _like(x, w.g.node("Pad", inputs, hint=var.name, mode=mode))


def _probe_pad(func, shape_in, shape_out, dtype):
    """``(widths, mode, value)`` if ``func`` pads its input (``numpy.pad`` modes
    ``constant`` and ``edge``), else None."""
    import tvm

    if func is None or len(shape_in) != len(shape_out):
        return None
    size = int(np.prod(shape_in))
    probe = (np.arange(size) % (size if dtype == "float32" else 100) + 1).reshape(shape_in)
    probe = probe.astype(dtype)
    try:
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")
        out = tvm.runtime.tensor(np.zeros(shape_out, dtype))
        lib["main"](tvm.runtime.tensor(probe), out)
    except Exception:  # not a plain function of one tensor
        return None
    out = out.numpy()
    where = np.argwhere(out == probe.flat[0])
    if not len(where):
        return None
    before = [int(v) for v in where[-1]]  # edge mode repeats the corner before it
    widths = [(b, o - i - b) for b, i, o in zip(before, shape_in, shape_out, strict=True)]
    if any(b < 0 or a < 0 for b, a in widths):
        return None
    if np.array_equal(out, np.pad(probe, widths, mode="edge")):
        return widths, "edge", None
    value = out.flat[0] if any(b for b, _ in widths) else out.flat[-1]
    if np.array_equal(out, np.pad(probe, widths, constant_values=value)):
        return widths, "constant", value.item()
    return None


def _gelu_tanh(g, x, hint):
    return g.node("Gelu", [x], hint=hint, approximate="tanh")


def _silu(g, x, hint):
    return g.node("Mul", [x, g.node("Sigmoid", [x])], hint=hint)


def _rsqrt(g, x, hint):
    return g.node("Reciprocal", [g.node("Sqrt", [x])], hint=hint)


def _op(name, **attrs):
    return lambda g, x, hint: g.node(name, [x], hint=hint, **attrs)


#: Relax op -> rule(writer, call, var) -> the binding's value in the ONNX graph
RULES = {
    "relax.add": _binary("Add"),
    "relax.subtract": _binary("Sub"),
    "relax.multiply": _binary("Mul"),
    "relax.divide": _binary("Div"),
    "relax.power": _binary("Pow"),
    "relax.maximum": _binary("Max"),
    "relax.minimum": _binary("Min"),
    "relax.matmul": _binary("MatMul"),
    "relax.where": lambda w, call, var: Float(
        w.g.node("Where", [w.value(a).name for a in call.args], hint=var.name)
    ),
    "relax.astype": astype,
    "relax.less": _compare("Less"),
    "relax.greater": _compare("Greater"),
    "relax.equal": _compare("Equal"),
    "relax.less_equal": _compare("LessOrEqual"),
    "relax.greater_equal": _compare("GreaterOrEqual"),
    "relax.logical_and": _compare("And"),
    "relax.logical_or": _compare("Or"),
    "relax.shape_of": static_shape,
    "relax.shape_to_tensor": shape_to_tensor,
    "relax.broadcast_to": broadcast_to,
    "relax.nn.relu": _unary("Relu"),
    "relax.negative": _unary("Neg"),
    "relax.abs": _unary("Abs"),
    "relax.sigmoid": _float_unary(_op("Sigmoid")),
    "relax.tanh": _float_unary(_op("Tanh")),
    "relax.exp": _float_unary(_op("Exp")),
    "relax.log": _float_unary(_op("Log")),
    "relax.sqrt": _float_unary(_op("Sqrt")),
    "relax.rsqrt": _float_unary(_rsqrt),
    "relax.erf": _float_unary(_op("Erf")),
    "relax.nn.gelu": _float_unary(_op("Gelu")),
    "relax.nn.gelu_tanh": _float_unary(_gelu_tanh),
    "relax.nn.silu": _float_unary(_silu),
    "relax.clip": clip,
    "relax.nn.softmax": softmax,
    "relax.nn.layer_norm": layer_norm,
    "relax.nn.max_pool2d": max_pool2d,
    "relax.nn.avg_pool2d": avg_pool2d,
    "relax.nn.adaptive_avg_pool2d": adaptive_avg_pool2d,
    "relax.nn.conv2d": conv2d,
    "relax.nn.conv2d_transpose": conv2d_transpose,
    "relax.image.resize2d": resize2d,
    "relax.mean": _reduce("ReduceMean"),
    "relax.sum": _reduce("ReduceSum"),
    "relax.max": _reduce("ReduceMax"),
    "relax.reshape": _reshape,
    "relax.flatten": _reshape,
    "relax.squeeze": _reshape,
    "relax.expand_dims": _reshape,
    "relax.permute_dims": permute_dims,
    "relax.concat": concat,
    "relax.split": split,
    "relax.strided_slice": strided_slice,
    "relax.take": take,
    "relax.call_tir": call_tir,
}
