"""Stage 1 for TFLite models: a full-integer ``.tflite`` flatbuffer -> an ONNX QDQ model.

``import_quantized("model.tflite")`` rewrites the TFLite graph, one rule per TFLite op
(:data:`RULES`), into the QDQ form the ONNX reader already takes (:mod:`.file_qparams`), so
the float graph, the one pattern match, the fallback and realize are shared: each TFLite
activation tensor becomes ``DequantizeLinear(QuantizeLinear(float op))`` with the file's
scale and zero point, int8 weights stay integer initializers behind ``DequantizeLinear``
(per-channel scales), int32 biases likewise (their scale is the file's
``input_scale * weight_scale``). The flatbuffer is read with the ``tflite`` package.

Layout (the decision): TFLite is NHWC, autoq's canonical form and its patterns are NCHW.
Inside, every 4-D activation is NCHW: the int8 NHWC graph inputs are dequantized and
transposed once at the start, 4-D outputs transposed back at the end (on the integers: a
transpose commutes with quantization), conv weights ``OHWI -> OIHW``, depthwise
``1HW(C*m) -> (C*m)1HW`` with ``group = C``, and ops that read axes (MEAN, RESHAPE,
FULLY_CONNECTED of a 4-D tensor) map them or transpose back to NHWC first. The imported
module takes and returns the file's int8 NHWC tensors.

Fused activations (RELU, RELU6, RELU_N1_TO_1) are ``Relu``/``Clip`` before the output's
quantize: TFLite clamps the requantized integers to ``[Q(lo), Q(hi)]``, which is the same.
Unsupported ops and non-int8 tensors are a :class:`.onnx_graph.QuantizedImportError` naming
the op and tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoq.importers.onnx_graph import QuantizedImportError

__all__ = ["RULES", "is_tflite", "tflite_to_qdq"]

_NHWC_TO_NCHW = (0, 3, 1, 2)
_NCHW_TO_NHWC = (0, 2, 3, 1)
#: TFLite TensorType -> numpy dtype
_TYPES = {0: np.float32, 2: np.int32, 3: np.uint8, 4: np.int64, 7: np.int16, 9: np.int8}
#: fused activation function -> (lo, hi) of the clamp (None: no clamp)
_ACTIVATIONS = {0: None, 1: (0.0, None), 2: (-1.0, 1.0), 3: (0.0, 6.0)}


def is_tflite(source) -> bool:
    """Whether ``source`` is a TFLite flatbuffer (a path or bytes with the ``TFL3`` id)."""
    if isinstance(source, bytes | bytearray):
        return bytes(source[4:8]) == b"TFL3"
    if isinstance(source, str | os.PathLike) and os.path.isfile(source):
        with open(source, "rb") as f:
            head = f.read(8)
        return head[4:8] == b"TFL3"
    return False


@dataclass
class _Ctx:
    """The TFLite subgraph being rewritten and the ONNX graph being written."""

    model: Any
    graph: Any
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    #: TFLite tensor index -> ONNX name of its (float, dequantized) value
    value: dict[int, str] = field(default_factory=dict)
    #: TFLite tensor index -> whether that value is NCHW (4-D activations)
    nchw: dict[int, bool] = field(default_factory=dict)
    counter: int = 0

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}:{self.counter}"

    def tensor(self, i: int):
        return self.graph.Tensors(int(i))

    def name(self, i: int) -> str:
        return self.tensor(i).Name().decode()

    def shape(self, i: int) -> list[int]:
        return [int(d) for d in self.tensor(i).ShapeAsNumpy()]

    def dtype(self, i: int):
        t = self.tensor(i).Type()
        if t not in _TYPES:
            raise QuantizedImportError(f"tensor {self.name(i)!r}: TFLite type {t} not supported")
        return np.dtype(_TYPES[t])

    def buffer(self, i: int) -> np.ndarray | None:
        buf = self.model.Buffers(self.tensor(i).Buffer())
        data = buf.DataAsNumpy() if buf is not None and buf.DataLength() else None
        if data is None or isinstance(data, int):
            return None
        return np.frombuffer(data.tobytes(), self.dtype(i)).reshape(self.shape(i))

    def qparams(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        q = self.tensor(i).Quantization()
        if q is None or q.ScaleLength() == 0:
            raise QuantizedImportError(
                f"tensor {self.name(i)!r} is not quantized; only full-integer TFLite models "
                "(int8 activations and weights) can be imported"
            )
        return (
            q.ScaleAsNumpy().astype(np.float32),
            q.ZeroPointAsNumpy().astype(np.int64),
            int(q.QuantizedDimension()),
        )

    # ---- ONNX writing
    def node(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        from onnx import helper

        out = out or self.fresh(op_type)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, array, dtype) -> str:
        return self.init(self.fresh("const"), np.asarray(array, dtype))

    def scale_zp(self, i: int, dtype=None) -> tuple[str, str, int]:
        s, z, axis = self.qparams(i)
        dtype = dtype or self.dtype(i)
        if s.size == 1:
            return self.const(s.reshape(()), np.float32), self.const(z.reshape(()), dtype), axis
        return self.const(s, np.float32), self.const(z, dtype), axis


# ---------------------------------------------------------------------- activations


def _input(ctx: _Ctx, i: int, nchw: bool = True) -> str:
    """The float value of activation ``i`` in NCHW (4-D) or as TFLite holds it."""
    name = ctx.value[int(i)]
    if ctx.nchw.get(int(i)) and not nchw:
        return ctx.node("Transpose", [name], perm=list(_NCHW_TO_NHWC))
    return name


def _output(ctx: _Ctx, i: int, float_value: str, activation: int = 0, nchw: bool = True) -> None:
    """Quantize ``float_value`` (after the fused activation) with tensor ``i``'s qparams."""
    lo_hi = _ACTIVATIONS.get(activation)
    if activation not in _ACTIVATIONS:
        raise QuantizedImportError(
            f"tensor {ctx.name(i)!r}: fused activation {activation} not supported"
        )
    if lo_hi is not None:
        lo, hi = lo_hi
        if hi is None:
            float_value = ctx.node("Relu", [float_value])
        else:
            lo_c, hi_c = ctx.const(lo, np.float32), ctx.const(hi, np.float32)
            float_value = ctx.node("Clip", [float_value, lo_c, hi_c])
    if ctx.dtype(i) not in (np.int8, np.uint8):
        raise QuantizedImportError(
            f"tensor {ctx.name(i)!r} is {ctx.dtype(i)}; only int8/uint8 activations are supported"
        )
    # the float value takes the TFLite tensor's name (report.tensors, fallback reasons)
    producer = ctx.nodes[-1]
    if producer.output[0] == float_value:
        producer.output[0] = float_value = ctx.name(i)
    s, z, _ = ctx.scale_zp(i)
    q = ctx.node("QuantizeLinear", [float_value, s, z], ctx.name(i) + ":q")
    ctx.value[int(i)] = ctx.node("DequantizeLinear", [q, s, z], ctx.name(i) + ":dq")
    ctx.nchw[int(i)] = nchw and len(ctx.shape(i)) == 4


def _weight(ctx: _Ctx, i: int, perm: tuple[int, ...] | None, axis_after: int) -> str:
    """``DequantizeLinear`` of the integer weight ``i`` (transposed by ``perm``)."""
    w = ctx.buffer(i)
    if w is None or ctx.dtype(i) not in (np.int8, np.uint8):
        raise QuantizedImportError(f"weight {ctx.name(i)!r} is not an int8 constant")
    if perm is not None:
        w = np.transpose(w, perm)
    s, z, _ = ctx.scale_zp(i)
    wname = ctx.init(ctx.name(i), w)
    attrs = {"axis": axis_after} if ctx.qparams(i)[0].size > 1 else {}
    return ctx.node("DequantizeLinear", [wname, s, z], **attrs)


def _bias(ctx: _Ctx, i: int) -> str | None:
    if i < 0:
        return None
    b = ctx.buffer(i)
    if b is None or ctx.dtype(i) != np.int32:
        raise QuantizedImportError(f"bias {ctx.name(i)!r} is not an int32 constant")
    s, z, _ = ctx.scale_zp(i, np.int32)
    attrs = {"axis": 0} if ctx.qparams(i)[0].size > 1 else {}
    return ctx.node("DequantizeLinear", [ctx.init(ctx.name(i), b), s, z], **attrs)


# ---------------------------------------------------------------------- the op rules


def _options(op, cls):
    table = op.BuiltinOptions()
    opts = cls()
    opts.Init(table.Bytes, table.Pos)
    return opts


def _same_pads(in_hw, k_hw, strides, dilations, padding: int) -> list[int]:
    """TensorFlow's SAME (``padding == 0``) / VALID padding as ONNX ``pads``."""
    if padding != 0:
        return [0, 0, 0, 0]
    before, after = [], []
    for n, k, s, d in zip(in_hw, k_hw, strides, dilations, strict=True):
        out = -(-n // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        before.append(total // 2)
        after.append(total - total // 2)
    return before + after


def _conv(ctx: _Ctx, op, depthwise: bool) -> None:
    from tflite.Conv2DOptions import Conv2DOptions
    from tflite.DepthwiseConv2DOptions import DepthwiseConv2DOptions

    ins, out = op.InputsAsNumpy(), op.OutputsAsNumpy()[0]
    o = _options(op, DepthwiseConv2DOptions if depthwise else Conv2DOptions)
    kh, kw = ctx.shape(ins[1])[1:3]
    strides, dil = [o.StrideH(), o.StrideW()], [o.DilationHFactor(), o.DilationWFactor()]
    in_hw = ctx.shape(ins[0])[1:3]
    pads = _same_pads(in_hw, (kh, kw), strides, dil, o.Padding())
    perm = (3, 0, 1, 2) if depthwise else (0, 3, 1, 2)  # -> OIHW / (C*m)1HW
    w = _weight(ctx, ins[1], perm, 0)
    args = [_input(ctx, ins[0]), w] + ([b] if (b := _bias(ctx, ins[2])) else [])
    group = ctx.shape(ins[0])[3] if depthwise else 1
    y = ctx.node(
        "Conv", args, kernel_shape=[kh, kw], strides=strides, dilations=dil, pads=pads, group=group
    )
    _output(ctx, out, y, o.FusedActivationFunction())


def _fully_connected(ctx: _Ctx, op) -> None:
    from tflite.FullyConnectedOptions import FullyConnectedOptions

    ins, out = op.InputsAsNumpy(), op.OutputsAsNumpy()[0]
    o = _options(op, FullyConnectedOptions)
    x = _input(ctx, ins[0], nchw=False)
    k = ctx.shape(ins[1])[1]
    if len(ctx.shape(ins[0])) != 2:
        x = ctx.node("Reshape", [x, ctx.const([-1, k], np.int64)])
    args = [x, _weight(ctx, ins[1], None, 0)]
    b = _bias(ctx, ins[2]) if len(ins) > 2 else None
    args += [b] if b else []
    y = ctx.node("Gemm", args, transB=1)
    _output(ctx, out, y, o.FusedActivationFunction(), nchw=False)


def _add(ctx: _Ctx, op) -> None:
    from tflite.AddOptions import AddOptions

    ins, out = op.InputsAsNumpy(), op.OutputsAsNumpy()[0]
    layouts = {bool(ctx.nchw.get(int(i))) for i in ins}
    nchw = layouts == {True}
    y = ctx.node("Add", [_input(ctx, i, nchw) for i in ins])
    _output(ctx, out, y, _options(op, AddOptions).FusedActivationFunction(), nchw)


def _pool(ctx: _Ctx, op, onnx_op: str) -> None:
    from tflite.Pool2DOptions import Pool2DOptions

    ins, out = op.InputsAsNumpy(), op.OutputsAsNumpy()[0]
    o = _options(op, Pool2DOptions)
    k = [o.FilterHeight(), o.FilterWidth()]
    strides = [o.StrideH(), o.StrideW()]
    pads = _same_pads(ctx.shape(ins[0])[1:3], k, strides, (1, 1), o.Padding())
    y = ctx.node(onnx_op, [_input(ctx, ins[0])], kernel_shape=k, strides=strides, pads=pads)
    _output(ctx, out, y, o.FusedActivationFunction())


def _mean(ctx: _Ctx, op) -> None:
    from tflite.ReducerOptions import ReducerOptions

    ins, out = op.InputsAsNumpy(), op.OutputsAsNumpy()[0]
    axes = ctx.buffer(ins[1])
    if axes is None:
        raise QuantizedImportError(f"MEAN {ctx.name(out)!r}: the axes are not constant")
    rank = len(ctx.shape(ins[0]))
    axes = [int(a) % rank for a in axes.reshape(-1)]
    keep = bool(_options(op, ReducerOptions).KeepDims())
    nchw = bool(ctx.nchw.get(int(ins[0]))) and keep
    if ctx.nchw.get(int(ins[0])) and not keep:
        # reduce in NCHW, the result (rank < 4) has the remaining axes in NHWC order
        keep_axes = [a for a in range(4) if a not in axes]
        if keep_axes != sorted(keep_axes, key=lambda a: _NHWC_TO_NCHW.index(a)):
            raise QuantizedImportError(f"MEAN {ctx.name(out)!r}: axes {axes} not supported")
    axes = [_NHWC_TO_NCHW.index(a) for a in axes] if ctx.nchw.get(int(ins[0])) else axes
    y = ctx.node("ReduceMean", [_input(ctx, ins[0])], axes=axes, keepdims=int(keep))
    _output(ctx, out, y, 0, nchw)


def _reshape(ctx: _Ctx, op) -> None:
    ins, out = op.InputsAsNumpy(), op.OutputsAsNumpy()[0]
    shape = ctx.const(ctx.shape(out), np.int64)
    y = ctx.node("Reshape", [_input(ctx, ins[0], nchw=False), shape])
    if len(ctx.shape(out)) == 4:
        y = ctx.node("Transpose", [y], perm=list(_NHWC_TO_NCHW))
    _output(ctx, out, y, 0)


#: TFLite builtin op name -> rule writing its ONNX QDQ nodes
RULES = {
    "CONV_2D": lambda ctx, op: _conv(ctx, op, depthwise=False),
    "DEPTHWISE_CONV_2D": lambda ctx, op: _conv(ctx, op, depthwise=True),
    "FULLY_CONNECTED": _fully_connected,
    "ADD": _add,
    "AVERAGE_POOL_2D": lambda ctx, op: _pool(ctx, op, "AveragePool"),
    "MAX_POOL_2D": lambda ctx, op: _pool(ctx, op, "MaxPool"),
    "MEAN": _mean,
    "RESHAPE": _reshape,
}


# ---------------------------------------------------------------------- the model


def _load(source):
    try:
        import tflite
    except ImportError:
        raise ImportError(
            "importing .tflite files needs the flatbuffer reader: pip install 'autoq[tflite]' "
            "(tflite)"
        ) from None
    data = source if isinstance(source, bytes | bytearray) else open(source, "rb").read()
    model = tflite.Model.GetRootAsModel(bytearray(data), 0)
    if model.SubgraphsLength() != 1:
        raise QuantizedImportError(
            f"the TFLite model has {model.SubgraphsLength()} subgraphs; only one is supported"
        )
    return model


def _op_name(model, op) -> str:
    from tflite.BuiltinOperator import BuiltinOperator

    names = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    code = model.OperatorCodes(op.OpcodeIndex())
    return names.get(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()), "CUSTOM")


def _graph_io(ctx: _Ctx):
    """ONNX graph inputs (int8 NHWC, dequantized and transposed) and the output writer."""
    from onnx import helper

    inputs = []
    for i in ctx.graph.InputsAsNumpy():
        elem = helper.np_dtype_to_tensor_dtype(ctx.dtype(i))
        inputs.append(helper.make_tensor_value_info(ctx.name(i), elem, ctx.shape(i)))
        s, z, _ = ctx.scale_zp(i)
        x = ctx.node("DequantizeLinear", [ctx.name(i), s, z])
        if len(ctx.shape(i)) == 4:
            x = ctx.node("Transpose", [x], perm=list(_NHWC_TO_NCHW))
            ctx.nchw[int(i)] = True
        ctx.value[int(i)] = x
    return inputs


def _graph_outputs(ctx: _Ctx) -> list:
    from onnx import helper

    outputs = []
    for i in ctx.graph.OutputsAsNumpy():
        s, z, _ = ctx.scale_zp(i)
        name = ctx.name(i) + ":out"
        ctx.node("QuantizeLinear", [_input(ctx, i, nchw=False), s, z], name)
        elem = helper.np_dtype_to_tensor_dtype(ctx.dtype(i))
        outputs.append(helper.make_tensor_value_info(name, elem, ctx.shape(i)))
    return outputs


def tflite_to_qdq(source):
    """The ONNX QDQ model (opset 17) equivalent to a full-integer TFLite model (module doc)."""
    from onnx import helper

    model = _load(source)
    ctx = _Ctx(model, model.Subgraphs(0))
    inputs = _graph_io(ctx)
    for k in range(ctx.graph.OperatorsLength()):
        op = ctx.graph.Operators(k)
        name = _op_name(model, op)
        if name not in RULES:
            out = ctx.name(op.OutputsAsNumpy()[0])
            raise QuantizedImportError(
                f"TFLite op {name} (output {out!r}) is not supported; supported: {', '.join(RULES)}"
            )
        RULES[name](ctx, op)
    outputs = _graph_outputs(ctx)
    graph = helper.make_graph(ctx.nodes, "tflite", inputs, outputs, ctx.inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10, producer_name="autoq"
    )
