"""Import ONNX models that are already quantized, in autoq's canonical integer form.

``import_quantized(model) -> (mod, qparams, report)`` reads a QDQ model
(QuantizeLinear/DequantizeLinear around the ops) or a QOperator model (QLinearConv,
QLinearMatMul, ConvInteger, MatMulInteger and ONNX Runtime's com.microsoft QGemm,
QLinearAdd, QLinearMul, QLinearConcat, QLinearGlobalAveragePool, QLinearAveragePool,
QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax, QLinearReduceMean) and returns what
:func:`autoq.quantize` returns for a float model: the int8 module (``qnn.quantize ->
qnn.conv2d/dense/matmul -> add(int32 bias) -> qnn.requantize -> ...``), with the file's
integer weights and biases as constants (never dequantized and requantized) and the file's
scales and zero points, plus those qparams as a :class:`QParams` (the same data a
calibration produces: per-layer reports, fallback and re-export work on it).

How (each step is a function below):

1. **QOperator -> QDQ** (:func:`qoperator_to_qdq`). Every QOperator node is rewritten into
   DequantizeLinear on its integer inputs, the float op, and QuantizeLinear on its output;
   integer data-movement ops between them (MaxPool, Reshape, Flatten, Transpose, Pad,
   Resize, ...) become DequantizeLinear -> op -> QuantizeLinear with their input's qparams.
   One path then handles both formats.
2. **QDQ -> float graph + records** (:func:`split_qdq`). ``DQ(Q(t))`` becomes ``t`` and the
   file's (scale, zero point, dtype) of ``t`` is recorded; ``DQ(integer initializer)``
   becomes a float initializer named like the weight (``conv1.weight_quantized`` ->
   ``conv1.weight``, so autoq's layer ids are the file's weight names) and the integers,
   scale, zero point and axis are recorded; int32 biases likewise. Integer graph inputs
   become float inputs and integer graph outputs float outputs (converted back at the end).
   Every quantized activation tensor is added as an extra graph output.
3. **Import** with :func:`autoq.frontends.from_onnx`. TVM's importer drops node names, but
   outputs survive: output ``k`` tells which Relax variable the ``k``-th quantized ONNX
   tensor became. The extra outputs stay in the module until the very end, which also
   keeps the pattern matcher from fusing across a tensor the file quantizes (a match may
   not have a function output inside it): e.g. a file that quantizes a convolution's output
   before a residual Add gets ``conv2d_bias`` + ``qnn.add``, not ``conv2d_bias_add``.
4. **Slots** (:func:`autoq.simulate`). Every match whose activation inputs (and, for
   elementwise ops, output) the file quantizes and whose weight it stores as integers is
   quantized with the file's qparams; the others go to ``Fallback(ids=...)`` (their op runs
   as dequantize -> fp32 -> quantize) and are reported with the reason. Where a quantized
   tensor also feeds an op that runs in float (a fallback layer, softmax, a graph output the
   file dequantizes), a ``qnn.quantize -> qnn.dequantize`` pair with the file's qparams is
   inserted for that use, so the file's rounding happens there too.
5. **Realize** (:func:`autoq.realize`) with the integer weights/biases passed in
   ``QParams.values``; then the extra outputs are dropped, integer inputs/outputs restored
   (``qnn.dequantize``/``qnn.quantize`` at the boundary, merged by
   :func:`autoq.realize.propagate`), and ``astype(int32)`` of an exact unit-scale
   dequantize (ConvInteger/MatMulInteger outputs) removed.

Rounding: the ONNX reference for QLinearConv/QLinearMatMul rounds ``acc * (sx*sw/sy)``
(float64 in onnx's reference, float32 in ONNX Runtime); our default ``rounding="float"``
computes ``round(float32(float32(acc) * float32(sx*sw)) / sy)``. The two can differ only
within float32 rounding of a tie (see tests/test_import_quantized.py for what was measured).

Not supported (a clear error or a fallback, never a silent change): runtime (non-constant)
scales or zero points (DynamicQuantizeLinear), blocked quantization, per-axis activation
quantization, a tensor quantized twice with different qparams, QAttention and the other
contrib ops not listed above, QGemm with ``alpha != 1``, ConvInteger/MatMulInteger whose
input was quantized with a scale other than 1.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import relax

from . import qnn
from .allow_list import ALLOW_LIST
from .config import Config, Fallback
from .graph import Graph
from .qparams import QParam, QParams
from .realize import propagate, realize
from .registry import Match, slot_id_of
from .simulate import SimResult, simulate
from .toolkit import BindingWriter, bindings, const_array, dtype_of, op_name, remap_expr, with_main

__all__ = [
    "ImportReport",
    "QuantizedImportError",
    "import_quantized",
    "is_quantized_onnx",
    "qoperator_to_qdq",
    "split_qdq",
]


class QuantizedImportError(ValueError):
    """The quantized file uses something the importer cannot represent exactly."""


_MS = "com.microsoft"
_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
#: QOperator op types (default and com.microsoft domains) handled by qoperator_to_qdq
_QOPERATOR_OPS = (
    "QLinearConv",
    "QLinearMatMul",
    "ConvInteger",
    "MatMulInteger",
    "QGemm",
    "QLinearAdd",
    "QLinearMul",
    "QLinearConcat",
    "QLinearGlobalAveragePool",
    "QLinearAveragePool",
    "QLinearSigmoid",
    "QLinearLeakyRelu",
    "QLinearSoftmax",
    "QLinearReduceMean",
)
#: integer ops that only move or select values: output qparams = input qparams
_INT_PASSTHROUGH = (
    "MaxPool",
    "GlobalMaxPool",
    "Flatten",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Slice",
    "Gather",
    "Identity",
    "Resize",
    "Upsample",
    "Pad",
    "Concat",
    "Split",
    "DepthToSpace",
    "SpaceToDepth",
    "Tile",
    "Expand",
    "Relu",
    "Clip",
    "ReduceMax",
    "ReduceMin",
)
_QUANT_DTYPES = ("int8", "uint8", "int16", "uint16")
#: name prefix of the Cast that qoperator_to_qdq puts after ConvInteger/MatMulInteger
_INT32_CAST = "autoq/int32_accumulator/"


# ------------------------------------------------------------------------------ report


@dataclass
class ImportReport:
    """What :func:`import_quantized` found and did.

    ``format``: "QDQ" or "QOperator". ``rewritten``: QOperator op type ->
    nodes rewritten into QDQ form. ``layers``: layer id -> pattern, the integer layers.
    ``fallback``: layer id -> why the layer runs in fp32 (dequantize -> fp32 op -> quantize).
    ``float_ops``: ONNX nodes (``name (OpType)``) next to quantized tensors that run in fp32
    in the imported module, with their Relax op. ``notes``: anything else worth knowing
    (biases rescaled, biases quantized here because the file kept them in float).
    ``timings``: seconds per step. ``float_mod``, ``params``, ``config``: the float module
    (with the file's rounding points) that was realized, its weights, and the config used:
    ``realize(float_mod, params, qparams, config)`` rebuilds the module before its integer
    inputs/outputs are restored.
    """

    format: str = ""
    rewritten: dict[str, int] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)
    float_ops: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    activation_tensors: int = 0
    weight_tensors: int = 0
    float_mod: Any = field(default=None, repr=False)
    params: dict | None = field(default=None, repr=False)
    config: Config | None = field(default=None, repr=False)

    def summary(self) -> str:
        lines = [
            f"format {self.format}; {len(self.layers)} integer layers, {len(self.fallback)} "
            f"fallback, {self.activation_tensors} quantized activations, "
            f"{self.weight_tensors} integer weights/biases"
        ]
        if self.rewritten:
            lines.append(
                "rewritten to QDQ: " + ", ".join(f"{k} x{v}" for k, v in self.rewritten.items())
            )
        for k, v in self.fallback.items():
            lines.append(f"fallback {k}: {v}")
        for k, v in self.float_ops.items():
            lines.append(f"fp32 op {k}: {v}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# --------------------------------------------------------------------------- ONNX helpers


def _onnx():
    import onnx

    return onnx


def _load(path_or_model):
    onnx = _onnx()
    if isinstance(path_or_model, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(path_or_model)
        return model
    if isinstance(path_or_model, bytes | bytearray):
        return onnx.load_from_string(bytes(path_or_model))
    if isinstance(path_or_model, str | os.PathLike):
        if not Path(path_or_model).is_file():
            raise FileNotFoundError(f"no ONNX file at {str(path_or_model)!r}")
        return onnx.load(str(path_or_model))
    raise TypeError(
        f"import_quantized takes a path, an onnx.ModelProto or bytes, got {type(path_or_model).__name__}"
    )


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(_onnx().helper.tensor_dtype_to_np_dtype(elem_type))


def _constants(model) -> dict[str, np.ndarray]:
    """Initializers and Constant node values by name."""
    onnx = _onnx()
    from onnx import numpy_helper

    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for a in node.attribute:
                v = onnx.helper.get_attribute_value(a)
                if a.name == "value":
                    out[node.output[0]] = numpy_helper.to_array(v)
                elif a.name in ("value_float", "value_int", "value_floats", "value_ints"):
                    out[node.output[0]] = np.asarray(
                        v, np.float32 if "float" in a.name else np.int64
                    )
    return out


def _attrs(node) -> dict[str, Any]:
    onnx = _onnx()
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _node_label(node, k: int | None = None) -> str:
    name = node.name or (f"{node.op_type}#{k}" if k is not None else node.output[0])
    return f"{name} ({node.op_type})"


def _is_qoperator(node) -> bool:
    return node.op_type in _QOPERATOR_OPS and node.domain in ("", "ai.onnx", _MS)


def _is_qdq(node) -> bool:
    return node.op_type in _QDQ_OPS and node.domain in ("", "ai.onnx", _MS)


def is_quantized_onnx(path_or_model) -> bool:
    """Whether an ONNX model holds QuantizeLinear/DequantizeLinear or QOperator nodes."""
    model = _load(path_or_model)
    return any(_is_qdq(n) or _is_qoperator(n) for n in model.graph.node)


def _default_opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


class _Names:
    """Fresh tensor names."""

    def __init__(self, model):
        self.taken = {t.name for t in model.graph.initializer}
        self.taken |= {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
        for n in model.graph.node:
            self.taken |= set(n.input) | set(n.output)

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name = f"{base}_{k}"
            k += 1
        self.taken.add(name)
        return name


# ------------------------------------------------------------------ 1. QOperator -> QDQ


def qoperator_to_qdq(model) -> tuple[Any, dict[str, int]]:
    """Rewrite every QOperator node of ``model`` (a copy is returned) into QDQ form.

    Returns ``(model, counts)`` with the number of rewritten nodes per op type. Integer
    tensors keep their names: a QOperator node producing ``y`` becomes
    ``DequantizeLinear`` on its inputs, the float op producing ``y/float``, and
    ``QuantizeLinear(y/float) -> y``.
    """
    onnx = _onnx()
    from onnx import helper, numpy_helper

    model = _load(model)
    graph = model.graph
    if not any(_is_qoperator(n) for n in graph.node):
        return model, {}
    consts = _constants(model)
    names = _Names(model)
    opset = _default_opset(model)
    new_nodes: list = []
    new_inits: list = []
    counts: Counter = Counter()
    # integer tensor -> (scale name, zero point name or None) of its quantization
    qinfo: dict[str, tuple[str, str | None]] = {}
    dq_cache: dict[tuple, str] = {}
    int_inputs = {
        i.name: i
        for i in graph.input
        if i.name not in consts and _np_dtype(i.type.tensor_type.elem_type).name in _QUANT_DTYPES
    }

    def const(base: str, value) -> str:
        name = names.fresh(base)
        new_inits.append(numpy_helper.from_array(np.asarray(value), name))
        consts[name] = np.asarray(value)
        return name

    def need_const(name: str | None, what: str, node) -> np.ndarray | None:
        if not name:
            return None
        if name not in consts:
            raise QuantizedImportError(
                f"{_node_label(node)}: {what} {name!r} is computed at run time; only constant "
                "scales and zero points can be imported (dynamic quantization is not supported)"
            )
        return consts[name]

    def dq(q: str, s: str, z: str | None, node, axis: int | None = None) -> str:
        need_const(s, "scale", node)
        need_const(z, "zero point", node)
        key = (q, s, z, axis)
        if key not in dq_cache:
            out = names.fresh(f"{q}/dequantized")
            kw = {} if axis is None else {"axis": axis}
            new_nodes.append(
                helper.make_node("DequantizeLinear", [q, s] + ([z] if z else []), [out], **kw)
            )
            dq_cache[key] = out
        return dq_cache[key]

    def quant(f: str, s: str, z: str | None, out: str, node) -> None:
        need_const(s, "scale", node)
        need_const(z, "zero point", node)
        if np.asarray(consts[s]).size != 1:
            raise QuantizedImportError(
                f"{_node_label(node)}: per-axis output quantization is not supported"
            )
        new_nodes.append(helper.make_node("QuantizeLinear", [f, s] + ([z] if z else []), [out]))
        qinfo[out] = (s, z)

    def same_qparams(a: tuple[str, str | None], b: tuple[str, str | None]) -> bool:
        """Whether the (scale, zero point) names ``a`` and ``b`` hold the same values."""
        return _same_arr(consts[a[0]], consts[b[0]]) and _same_arr(
            _zp(consts, a[1]), _zp(consts, b[1])
        )

    def per_axis(s: str, z: str | None, node) -> bool:
        """Whether the constant scale ``s`` / zero point ``z`` hold more than one value."""
        zp = need_const(z, "zero point", node)
        zsize = 1 if zp is None else np.asarray(zp).size
        return max(np.asarray(need_const(s, "scale", node)).size, zsize) > 1

    def check_same_qparams(q: str, s: str, z: str | None, node) -> None:
        if q in qinfo:
            s0, z0 = qinfo[q]
            if not same_qparams((s0, z0), (s, z)):
                raise QuantizedImportError(
                    f"{_node_label(node)} reads {q!r} with scale/zero point {s!r}/{z!r}, but it "
                    f"was quantized with {s0!r}/{z0!r}: a requantization inside a QOperator "
                    "node is not supported"
                )
        elif q in int_inputs:
            qinfo[q] = (s, z)

    def act_dq(q: str, s: str, z: str | None, node) -> str:
        """DQ of an activation operand (per-tensor; a constant operand may be per-axis 0)."""
        if q in consts:
            return dq(q, s, z, node, 0 if per_axis(s, z, node) else None)
        if per_axis(s, z, node):
            raise QuantizedImportError(
                f"{_node_label(node)}: per-axis quantization of an activation is not supported"
            )
        check_same_qparams(q, s, z, node)
        return dq(q, s, z, node)

    def weight_dq(w: str, s: str, z: str | None, node, axis: int) -> str:
        if w not in consts:
            return act_dq(w, s, z, node)
        return dq(w, s, z, node, axis if per_axis(s, z, node) else None)

    def bias_dq(b: str, scale: np.ndarray, node) -> str:
        if b not in consts:
            raise QuantizedImportError(f"{_node_label(node)}: bias {b!r} is not a constant")
        s = const(f"{b}_scale", np.asarray(scale, np.float32))
        return dq(b, s, None, node, 0 if np.asarray(scale).size > 1 else None)

    def float_out(y: str) -> str:
        return names.fresh(f"{y}/float")

    def copy_attrs(node, drop=()) -> dict:
        return {k: v for k, v in _attrs(node).items() if k not in drop}

    for k, node in enumerate(graph.node):
        op = node.op_type
        ins = list(node.input) + [""] * 10
        label = _node_label(node, k)
        if _is_qdq(node):
            if op == "QuantizeLinear" and node.output[0]:
                qinfo[node.output[0]] = (ins[1], ins[2] or None)
            new_nodes.append(node)
            continue
        if not _is_qoperator(node):
            qin = [i for i in node.input if i in qinfo or i in int_inputs]
            if not qin:
                new_nodes.append(node)
                continue
            if op not in _INT_PASSTHROUGH or node.domain not in ("", "ai.onnx"):
                raise QuantizedImportError(
                    f"{label} computes on quantized integers; only QLinear*/QDQ ops and data "
                    f"movement ({', '.join(_INT_PASSTHROUGH)}) are supported there"
                )
            first = qin[0]
            if first not in qinfo:
                s_name, z_name = _input_qparams_from_consumers(model, first, consts)
                qinfo[first] = (s_name, z_name)
            s, z = qinfo[first]
            new_in = []
            for pos, i in enumerate(node.input):
                if i in qinfo or i in int_inputs:
                    if i not in qinfo:
                        qinfo[i] = (s, z)
                    if op == "Concat" and not same_qparams(qinfo[i], (s, z)):
                        raise QuantizedImportError(
                            f"{label}: Concat of integer tensors with different qparams"
                        )
                    new_in.append(dq(i, *qinfo[i], node))
                elif (
                    i
                    and i in consts
                    and consts[i].dtype.name in _QUANT_DTYPES
                    and ((op == "Clip" and pos in (1, 2)) or (op == "Pad" and pos == 2))
                ):
                    # an integer bound / pad value: the real value it stands for
                    real = (
                        consts[i].astype(np.float64) - _zp(consts, z).astype(np.float64)
                    ) * consts[s]
                    new_in.append(const(f"{i}/float", real.astype(np.float32)))
                else:
                    new_in.append(i)
            outs = [float_out(o) for o in node.output]
            new_nodes.append(
                helper.make_node(
                    op, new_in, outs, name=node.name or f"{op}#{k}", domain=node.domain,
                    **copy_attrs(node),
                )
            )  # fmt: skip
            for o, f in zip(node.output, outs, strict=True):
                quant(f, s, z, o, node)
            continue
        counts[op] += 1
        y = node.output[0]
        if not node.name:  # the float op is reported under the QOperator node's label
            node.name = f"{op}#{k}"
        if op == "QLinearConv":
            x, xs, xz, w, ws, wz, ys, yz, b = ins[:9]
            xf = act_dq(x, xs, xz, node)
            wf = weight_dq(w, ws, wz, node, 0)
            fin = [xf, wf]
            if b:
                fin.append(
                    bias_dq(b, need_const(xs, "scale", node) * need_const(ws, "scale", node), node)
                )
            yf = float_out(y)
            new_nodes.append(
                helper.make_node("Conv", fin, [yf], name=node.name, **copy_attrs(node))
            )
            quant(yf, ys, yz or None, y, node)
        elif op == "QLinearMatMul":
            a, as_, az, b, bs, bz, ys, yz = ins[:8]
            af = act_dq(a, as_, az, node)
            rank_b = consts[b].ndim if b in consts else 2
            bf = weight_dq(b, bs, bz, node, rank_b - 1)
            yf = float_out(y)
            new_nodes.append(helper.make_node("MatMul", [af, bf], [yf], name=node.name))
            quant(yf, ys, yz or None, y, node)
        elif op in ("ConvInteger", "MatMulInteger"):
            x, w, xz, wz = ins[:4]
            one = const("unit_scale", np.float32(1.0))
            if x in qinfo and not _same_arr(consts[qinfo[x][0]], np.float32(1.0)):
                raise QuantizedImportError(
                    f"{label}: its input {x!r} was quantized with a scale other than 1; "
                    "ConvInteger/MatMulInteger after a static QuantizeLinear is not supported"
                )
            xz = xz or None
            if xz is not None and np.asarray(consts.get(xz, 0)).size > 1:
                raise QuantizedImportError(f"{label}: per-row input zero points are not supported")
            xf = dq(x, one, xz, node)
            if x in int_inputs and x not in qinfo:
                qinfo[x] = (one, xz)
            wz = wz or None
            if w in consts:
                wsize = np.asarray(consts[wz]).size if wz else 1
                waxis = (0 if op == "ConvInteger" else consts[w].ndim - 1) if wsize > 1 else None
                ws = one if waxis is None else const("unit_scales", np.ones(wsize, np.float32))
                wf = dq(w, ws, wz, node, waxis)
            else:
                if wz and np.asarray(consts[wz]).size > 1:
                    raise QuantizedImportError(f"{label}: per-axis zero points of an activation")
                if w in int_inputs and w not in qinfo:
                    qinfo[w] = (one, wz)
                wf = dq(w, one, wz, node)
            yf = float_out(y)
            core = "Conv" if op == "ConvInteger" else "MatMul"
            new_nodes.append(
                helper.make_node(core, [xf, wf], [yf], name=node.name, **copy_attrs(node))
            )
            # the exact integer accumulator (split_qdq recognizes this Cast by its name)
            new_nodes.append(
                helper.make_node(
                    "Cast",
                    [yf],
                    [y],
                    name=names.fresh(f"{_INT32_CAST}{y}"),
                    to=onnx.TensorProto.INT32,
                )
            )
        elif op == "QGemm":
            a, as_, az, b, bs, bz, c, ys, yz = ins[:9]
            at = _attrs(node)
            if float(at.get("alpha", 1.0)) != 1.0:
                raise QuantizedImportError(f"{label}: QGemm with alpha != 1 is not supported")
            af = act_dq(a, as_, az, node)
            trans_b = int(at.get("transB", 0))
            bf = weight_dq(b, bs, bz, node, 0 if trans_b else 1)
            fin = [af, bf]
            if c:
                fin.append(
                    bias_dq(c, need_const(as_, "scale", node) * need_const(bs, "scale", node), node)
                )
            yf = float_out(y) if ys else y
            new_nodes.append(
                helper.make_node("Gemm", fin, [yf], name=node.name, **copy_attrs(node, ("alpha",)))
            )
            if ys:
                quant(yf, ys, yz or None, y, node)
        elif op in ("QLinearAdd", "QLinearMul"):
            a, as_, az, b, bs, bz, ys, yz = ins[:8]
            fin = [act_dq(a, as_, az, node), act_dq(b, bs, bz, node)]
            yf = float_out(y)
            new_nodes.append(helper.make_node(op[len("QLinear") :], fin, [yf], name=node.name))
            quant(yf, ys, yz or None, y, node)
        elif op == "QLinearConcat":
            ys, yz = ins[0], ins[1] or None
            trip = list(node.input[2:])
            fin = [
                act_dq(trip[i], trip[i + 1], trip[i + 2] or None, node)
                for i in range(0, len(trip), 3)
            ]
            yf = float_out(y)
            new_nodes.append(
                helper.make_node("Concat", fin, [yf], name=node.name, **copy_attrs(node))
            )
            quant(yf, ys, yz, y, node)
        else:  # unary: X, x_scale, x_zp, y_scale, y_zp
            x, xs, xz, ys, yz = ins[:5]
            at = _attrs(node)
            if int(at.get("channels_last", 0)):
                raise QuantizedImportError(f"{label}: channels_last=1 is not supported")
            core = {
                "QLinearGlobalAveragePool": "GlobalAveragePool",
                "QLinearAveragePool": "AveragePool",
                "QLinearSigmoid": "Sigmoid",
                "QLinearLeakyRelu": "LeakyRelu",
                "QLinearSoftmax": "Softmax",
                "QLinearReduceMean": "ReduceMean",
            }[op]
            kw = copy_attrs(node, ("channels_last", "opset"))
            fin = [act_dq(x, xs, xz or None, node)]
            if core == "ReduceMean" and opset >= 18 and "axes" in kw:
                fin.append(const(f"{y}/axes", np.asarray(kw.pop("axes"), np.int64)))
            yf = float_out(y)
            new_nodes.append(helper.make_node(core, fin, [yf], name=node.name, **kw))
            quant(yf, ys, yz or None, y, node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(new_inits)
    return model, dict(counts)


def _zp(consts, name: str | None) -> np.ndarray:
    return np.zeros((), np.int64) if not name else np.asarray(consts[name]).astype(np.int64)


def _same_arr(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 1 and b.size == 1:
        return a.reshape(()).astype(np.float64) == b.reshape(()).astype(np.float64)
    return a.shape == b.shape and bool(np.all(a.astype(np.float64) == b.astype(np.float64)))


def _input_qparams_from_consumers(model, name: str, consts) -> tuple[str, str | None]:
    """Qparams of an integer graph input that first passes data-movement ops: the scale and
    zero point the first QLinear/DequantizeLinear consumer downstream reads it with."""
    consumers = defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            consumers[i].append(n)
    todo, seen = [name], set()
    while todo:
        t = todo.pop(0)
        if t in seen:
            continue
        seen.add(t)
        for n in consumers[t]:
            pos = list(n.input).index(t)
            if _is_qdq(n) and n.op_type == "DequantizeLinear":
                return n.input[1], (n.input[2] if len(n.input) > 2 and n.input[2] else None)
            if _is_qoperator(n) and n.op_type not in ("ConvInteger", "MatMulInteger"):
                # every QLinear* operand is followed by its scale and zero point
                ins = list(n.input) + [""] * 3
                return ins[pos + 1], ins[pos + 2] or None
            if n.op_type in _INT_PASSTHROUGH:
                todo.extend(n.output)
    raise QuantizedImportError(
        f"cannot tell the qparams of the integer input {name!r}: no QLinear or DequantizeLinear "
        "consumer reads it"
    )


# ------------------------------------------------------------- 2. QDQ -> float + records


@dataclass(frozen=True, eq=False)
class FileQ:
    """The file's quantization of one tensor: float32 scale and int zero point (0-d, or 1-d
    along ``axis`` of the tensor as stored in the file), and the integer dtype."""

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: str
    axis: int | None = None

    def same(self, other: FileQ) -> bool:
        return (
            self.dtype == other.dtype
            and self.axis == other.axis
            and self.scale.shape == other.scale.shape
            and bool(np.all(self.scale == other.scale))
            and bool(np.all(self.zero_point == other.zero_point))
        )

    def qparam(self, axis: int | None = None) -> QParam:
        return QParam(self.scale, self.zero_point.astype(np.int32), self.dtype, axis)


@dataclass
class FileConst:
    """A weight or bias the file stores as integers: ``name`` is the float initializer of the
    float graph, ``source`` the file's integer initializer; ``values`` in the file's layout."""

    name: str
    source: str
    values: np.ndarray
    q: FileQ


@dataclass
class SplitResult:
    """The float model and everything :func:`split_qdq` recorded."""

    model: Any
    n_outputs: int
    #: extra graph output k (after the originals) -> float tensor name
    extra_outputs: list[str]
    activations: dict[str, FileQ]
    consts: dict[str, FileConst]
    #: integer graph input name -> (file qparams, ONNX elem type)
    int_inputs: dict[str, tuple[FileQ, int]]
    #: original output index -> qparams: the file outputs integers (quantize at the end)
    int_outputs: dict[int, FileQ]
    #: original output indices the file computes as DequantizeLinear(QuantizeLinear(t))
    dq_outputs: set[int]
    #: float tensor name -> label of the ONNX node producing it
    producer: dict[str, str]
    #: float tensor name -> labels of the (non Q/DQ) ONNX nodes that read it
    consumers: dict[str, list[str]]
    #: weight parameter name of the imported module -> FileConst (see _bind_params)
    by_param: dict[str, FileConst] = field(default_factory=dict)

    def const(self, param_name: str | None) -> FileConst | None:
        return self.by_param.get(param_name) if param_name else None


def _qdq_params(node, consts, in_dtype: str | None) -> FileQ:
    """Constant scale / zero point of a QuantizeLinear or DequantizeLinear node."""
    label = _node_label(node)
    at = _attrs(node)
    if int(at.get("block_size", 0) or 0):
        raise QuantizedImportError(f"{label}: blocked quantization is not supported")
    ins = list(node.input) + [""] * 3
    for what, name in (("scale", ins[1]), ("zero point", ins[2])):
        if name and name not in consts:
            raise QuantizedImportError(
                f"{label}: the {what} {name!r} is computed at run time; only constant scales "
                "and zero points can be imported (dynamic quantization is not supported)"
            )
    scale = np.asarray(consts[ins[1]]).astype(np.float32)
    if ins[2]:
        zp_arr = np.asarray(consts[ins[2]])
        dtype = zp_arr.dtype.name
    else:
        if node.op_type == "QuantizeLinear":
            out_t = at.get("output_dtype", 0)
            dtype = _np_dtype(out_t).name if out_t else "uint8"
        else:
            dtype = in_dtype or "uint8"
        zp_arr = np.zeros(scale.shape, np.int64)
    if dtype not in (*_QUANT_DTYPES, "int32"):
        raise QuantizedImportError(f"{label}: quantized dtype {dtype} is not supported")
    zp = zp_arr.astype(np.int64)
    if scale.size == 1 and zp.size == 1:
        return FileQ(scale.reshape(()), zp.reshape(()), dtype, None)
    axis = int(at.get("axis", 1))
    return FileQ(
        scale.reshape(-1),
        np.broadcast_to(zp.reshape(-1), scale.reshape(-1).shape).copy(),
        dtype,
        axis,
    )


def _weight_name(source: str, taken: set[str]) -> str:
    """``conv1.weight_quantized`` -> ``conv1.weight`` (ONNX Runtime's suffix), if free."""
    for suffix in ("_quantized", "_Quantized", "_q", "_int8", "_uint8", "_int32"):
        if source.endswith(suffix) and len(source) > len(suffix):
            base = source[: -len(suffix)]
            if base not in taken:
                return base
    return source


def split_qdq(model, extra_outputs: bool = True) -> SplitResult:
    """The float graph of a QDQ model plus the file's quantization (module doc, step 2)."""
    onnx = _onnx()
    from onnx import helper, numpy_helper

    from . import primitives as P

    model = _load(model)
    graph = model.graph
    consts = _constants(model)
    init_names = {t.name for t in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in init_names}
    nodes = list(graph.node)
    labels = {id(n): _node_label(n, k) for k, n in enumerate(nodes)}

    # QuantizeLinear: output -> (input, qparams); constant inputs are folded to integers
    q_of: dict[str, tuple[str, FileQ, Any]] = {}
    folded: dict[str, np.ndarray] = {}
    for n in nodes:
        if _is_qdq(n) and n.op_type == "QuantizeLinear":
            qp = _qdq_params(n, consts, None)
            q_of[n.output[0]] = (n.input[0], qp, n)
            src = consts.get(n.input[0])
            if src is not None and src.dtype.kind == "f":
                axis = None if qp.axis is None else qp.axis % src.ndim
                folded[n.output[0]] = P.quantize(src, qp.scale, qp.zero_point, qp.dtype, axis)

    def in_dtype(name: str) -> str | None:
        if name in consts:
            return np.asarray(consts[name]).dtype.name
        if name in inputs:
            return _np_dtype(inputs[name].type.tensor_type.elem_type).name
        if name in q_of:
            return q_of[name][1].dtype
        return None

    all_names = set(init_names) | set(inputs) | {o.name for o in graph.output}
    for n in nodes:
        all_names |= set(n.input) | set(n.output)
    alias: dict[str, str] = {}
    activations: dict[str, FileQ] = {}
    fconsts: dict[str, FileConst] = {}
    by_source: dict[str, str] = {}
    int_inputs: dict[str, tuple[FileQ, int]] = {}
    new_inits = []

    def resolve(t: str) -> str:
        seen = set()
        while t in alias and t not in seen:
            seen.add(t)
            t = alias[t]
        return t

    def record_act(t: str, qp: FileQ, where: str) -> None:
        if qp.scale.ndim != 0:
            raise QuantizedImportError(
                f"{where}: per-axis quantization of the activation {t!r} is not supported"
            )
        if t in activations and not activations[t].same(qp):
            raise QuantizedImportError(
                f"{where}: the tensor {t!r} is quantized twice with different qparams"
            )
        activations[t] = qp

    for n in nodes:
        if not (_is_qdq(n) and n.op_type == "DequantizeLinear"):
            continue
        a, out = n.input[0], n.output[0]
        where = labels[id(n)]
        qp = _qdq_params(n, consts, in_dtype(a))
        if a in q_of and a not in folded:
            t, qq, qnode = q_of[a]
            t = resolve(t)  # Q(DQ(...)): a requantization shows up as a second qparams
            if not qp.same(qq):
                raise QuantizedImportError(
                    f"{where} dequantizes {a!r} with other qparams than {labels[id(qnode)]} "
                    "quantized it (a requantization); not supported"
                )
            record_act(t, qp, where)
            alias[out] = t
        elif a in folded or (
            a in consts and np.asarray(consts[a]).dtype.name in (*_QUANT_DTYPES, "int32")
        ):
            ints = folded[a] if a in folded else np.asarray(consts[a])
            source = q_of[a][0] if a in folded else a
            if a in by_source:
                prev = fconsts[by_source[a]]
                if not prev.q.same(qp):
                    raise QuantizedImportError(
                        f"{where}: the integer initializer {a!r} is dequantized with two different qparams"
                    )
                alias[out] = prev.name
                continue
            axis = None if qp.axis is None else qp.axis % max(ints.ndim, 1)
            qp = FileQ(qp.scale, qp.zero_point, qp.dtype, axis)
            name = _weight_name(source, all_names - {out})
            if name != source and name != out:
                all_names.add(name)
            values = P.dequantize(ints, qp.scale, qp.zero_point, axis)
            fconsts[name] = FileConst(name, source, np.ascontiguousarray(ints), qp)
            by_source[a] = name
            new_inits.append(numpy_helper.from_array(values.astype(np.float32), name))
            alias[out] = name
        elif a in inputs and in_dtype(a) in _QUANT_DTYPES:
            record_act(a, qp, where)
            if a in int_inputs and not int_inputs[a][0].same(qp):
                raise QuantizedImportError(
                    f"{where}: the input {a!r} is dequantized with two qparams"
                )
            int_inputs[a] = (qp, inputs[a].type.tensor_type.elem_type)
            alias[out] = a
        else:
            raise QuantizedImportError(
                f"{where} dequantizes {a!r}, which is neither a QuantizeLinear output, an integer "
                "initializer nor an integer graph input: not supported"
            )

    # QuantizeLinear outputs may feed only DequantizeLinear nodes and graph outputs
    for n in nodes:
        if _is_qdq(n):
            continue
        for i in n.input:
            if i in q_of:
                raise QuantizedImportError(
                    f"{labels[id(n)]} reads the quantized integers {i!r} directly; only "
                    "DequantizeLinear may (run qoperator_to_qdq first for QOperator models)"
                )

    # ConvInteger / MatMulInteger outputs: the float op's integer-valued result is the tensor
    int32_of: dict[str, str] = {}
    for n in nodes:
        if n.op_type == "Cast" and n.name.startswith(_INT32_CAST):
            int32_of[n.output[0]] = n.input[0]
            alias[n.output[0]] = n.input[0]

    kept = [n for n in nodes if not _is_qdq(n) and n.output[0] not in int32_of]
    producer: dict[str, str] = {}
    consumers: dict[str, list[str]] = defaultdict(list)
    for n in kept:
        new_in = [resolve(i) if i else i for i in n.input]
        del n.input[:]
        n.input.extend(new_in)
        for o in n.output:
            producer[o] = labels[id(n)]
        for i in set(new_in):
            if i:
                consumers[i].append(labels[id(n)])

    # graph outputs
    new_outputs = []
    int_outputs: dict[int, FileQ] = {}
    dq_outputs: set[int] = set()
    for k, o in enumerate(graph.output):
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(o)
        if o.name in alias and o.name not in int32_of:
            vi.name = resolve(o.name)
            dq_outputs.add(k)
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        elif o.name in int32_of:
            vi.name = resolve(o.name)
            int_outputs[k] = FileQ(np.float32(1.0), np.int64(0), "int32")
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        elif o.name in q_of:
            t, qp, _ = q_of[o.name]
            vi.name = resolve(t)
            int_outputs[k] = qp
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
            record_act(vi.name, qp, f"graph output {o.name!r}")
        new_outputs.append(vi)

    # drop initializers nobody reads any more (integer weights, scales, zero points)
    used = {i for n in kept for i in n.input} | {o.name for o in new_outputs}
    replaced = set(fconsts)
    inits = [t for t in graph.initializer if t.name in used and t.name not in replaced]
    inits += [t for t in new_inits if t.name in used]
    kept = [
        n
        for n in kept
        if not (n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output[0] not in used)
    ]
    for name in list(fconsts):
        if name not in used:
            del fconsts[name]

    new_inputs = []
    for i in graph.input:
        if i.name in init_names:
            continue  # old models list initializers as inputs too
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(i)
        if i.name in int_inputs:
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        new_inputs.append(vi)

    extras = []
    if extra_outputs:
        present = {o.name for o in new_outputs}
        for t in activations:
            if t not in present:
                present.add(t)
                extras.append(t)
                new_outputs.append(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))

    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(inits)
    del graph.input[:]
    graph.input.extend(new_inputs)
    n_outputs = len(graph.output)
    del graph.output[:]
    graph.output.extend(new_outputs)
    del graph.value_info[:]
    if not any(n.domain == _MS for n in kept):
        keep_ops = [o for o in model.opset_import if o.domain != _MS]
        del model.opset_import[:]
        model.opset_import.extend(keep_ops)
    return SplitResult(
        model,
        n_outputs,
        extras,
        activations,
        fconsts,
        int_inputs,
        int_outputs,
        dq_outputs,
        producer,
        dict(consumers),
    )


def _bind_params(split: SplitResult, params: dict[str, np.ndarray]) -> None:
    """Which imported weight parameter holds which integer initializer of the file.

    :func:`autoq.frontends.from_onnx` names parameters by initializer, without the prefixes
    ONNX Runtime's fusions add (``ConvAddFusion_Add_B_``). Binding is by name and size; a
    layer uses the integers only if the parameter still holds the file's dequantized values
    in some layout (checked by :func:`_weight_layout`).
    """
    from .frontends import ORT_FUSION_PREFIX as _ORT_FUSION_PREFIX

    def strip(name: str) -> str:
        while _ORT_FUSION_PREFIX.match(name):
            name = _ORT_FUSION_PREFIX.sub("", name, count=1)
        return name.removeprefix("onnx::")

    by_stripped: dict[str, list[FileConst]] = defaultdict(list)
    for c in split.consts.values():
        by_stripped[strip(c.name)].append(c)
    for name, arr in params.items():
        c = split.consts.get(name)
        if c is None:
            cands = by_stripped.get(strip(name), [])
            c = cands[0] if len(cands) == 1 else None
        if c is not None and np.asarray(arr).size == c.values.size:
            split.by_param[name] = c


# ----------------------------------------------------------- 3-5. Relax: slots, realize


def _output_fields(g: Graph) -> list:
    out = g.output
    if isinstance(out, relax.Var) and out in g.value:
        out = g.value[out]
    if isinstance(out, relax.Tuple):
        return list(out.fields)
    return [out]


# ops whose output lies on the input's quantization grid (the allow-list rows whose
# dequantize may move below them): a slot there has the input's qparams exactly
def _on_grid(value) -> bool:
    if not isinstance(value, tvm.ir.Call):
        return False
    rule = ALLOW_LIST.get(op_name(value))
    if rule is None or rule.kind != "commute" or not rule.dequantize_below:
        return False
    if op_name(value) == "relax.nn.pad":
        return str(value.attrs.pad_mode) == "constant" and float(value.attrs.pad_value) == 0.0
    return True


class _Tensors:
    """Which Relax variable of a prepared graph holds which quantized ONNX tensor."""

    def __init__(self, g: Graph, names: list[str], split: SplitResult):
        self.g, self.split = g, split
        self.var: dict[str, relax.Var] = {}
        self.name: dict[relax.Var, str] = {}
        fields = _output_fields(g)
        for pos, name in names:
            e = fields[pos]
            if isinstance(e, relax.Var):
                self.var.setdefault(name, e)
                self.name.setdefault(e, name)

    def resolve(self, var) -> tuple[str | None, list[relax.Var]]:
        """The quantized ONNX tensor whose grid ``var`` lies on (through on-grid ops)."""
        path = []
        seen = set()
        while isinstance(var, relax.Var) and var not in seen:
            seen.add(var)
            name = self.name.get(var)
            if name is not None and name in self.split.activations:
                return name, path
            value = self.g.value.get(var)
            if isinstance(value, relax.Var):
                var = value
            elif _on_grid(value) and isinstance(value.args[0], relax.Var):
                path.append(var)
                var = value.args[0]
            else:
                return None, path
        return None, path

    def describe(self, var) -> str:
        if var in self.name:
            return repr(self.name[var])
        ids = self.g.ids.get(var)
        return f"{ids} (not an ONNX tensor the file quantizes)"


def _output_names(split: SplitResult) -> list[tuple[int, str]]:
    """(output position, ONNX tensor) for every position that holds a quantized tensor."""
    model = split.model
    out = []
    for pos, o in enumerate(model.graph.output):
        if o.name in split.activations:
            out.append((pos, o.name))
    return out


def _match_inputs(g: Graph, m: Match) -> list[relax.Var]:
    """Activation operands of a match (data-dependent vars it reads but does not compute)."""
    covered = set(m.covered)
    out = []
    for v in m.nodes.values():
        if isinstance(v, relax.Var) and v not in covered and g.is_data_dependent(v):
            if not any(v.same_as(u) for u in out):
                out.append(v)
    return out


def _owns_output_slot(sim: SimResult, m: Match) -> bool:
    info = sim.slots.get(m.layer)
    t = sim.plan.tensors.get(m.layer)
    return info is not None and info.layer == m.layer and t is not None and t.same_as(m.root)


def _weight_layout(ref_array: np.ndarray, c: FileConst) -> tuple[int, ...] | None:
    """The permutation taking the file's initializer layout to the graph's weight layout."""
    import itertools

    f = _file_float(c)
    if f.shape == ref_array.shape and np.array_equal(f, ref_array):
        return tuple(range(f.ndim))
    if f.ndim > 4:
        return None
    for perm in itertools.permutations(range(f.ndim)):
        if tuple(f.shape[p] for p in perm) == ref_array.shape and np.array_equal(
            np.transpose(f, perm), ref_array
        ):
            return perm
    return None


def _file_float(c: FileConst) -> np.ndarray:
    from . import primitives as P

    return P.dequantize(c.values, c.q.scale, c.q.zero_point, c.q.axis)


@dataclass
class _Plan:
    qparams: dict[str, QParam]
    values: dict[str, np.ndarray]
    notes: list[str]


def _check_match(sim: SimResult, m: Match, tens: _Tensors, split: SplitResult) -> str | None:
    """Why match ``m`` cannot take its quantization from the file (None: it can)."""
    g = sim.graph
    accumulating = m.pattern.name.split("_")[0] in ("conv2d", "dense", "matmul")
    for v in _match_inputs(g, m):
        name, _ = tens.resolve(v)
        if name is None:
            return f"its input {tens.describe(v)} is not quantized in the file"
        dtype = split.activations[name].dtype
        if accumulating and dtype not in ("int8", "uint8"):
            return f"its input {name!r} is {dtype} (qnn.{m.pattern.name.split('_')[0]} takes int8/uint8)"
    if _owns_output_slot(sim, m):
        name = tens.name.get(m.root)
        if name is None or name not in split.activations:
            return "its output is not quantized in the file"
    wkey = m.pattern.weight
    if wkey and wkey in m.nodes:
        ref = g.weight_of(m.nodes[wkey])
        if ref is None or ref.name is None:
            return "its weight is not a named initializer"
        c = split.const(ref.name)
        if c is None:
            return f"its weight {ref.name!r} is stored in float in the file"
        if c.q.dtype not in ("int8", "uint8"):
            return f"its weight {ref.name!r} is {c.q.dtype} (qnn weights are int8/uint8)"
        perm = _weight_layout(ref.array, c)
        if perm is None:
            return (
                f"its weight {ref.name!r} no longer holds the file's values after import "
                "(changed by a fusion? try optimize=False)"
            )
        if c.q.axis is not None:
            axis = perm.index(c.q.axis)
            want = 0 if m.pattern.name.startswith("conv2d") else ref.array.ndim - 1
            if axis != want:
                return f"its weight {ref.name!r} is quantized per axis {c.q.axis}, not per output channel"
    return None


def _fill(sim: SimResult, tens: _Tensors, split: SplitResult) -> _Plan:
    """QParams for every slot of ``sim`` from the file, and the integer weights/biases."""
    g = sim.graph
    qps: dict[str, QParam] = {}
    values: dict[str, np.ndarray] = {}
    notes: list[str] = []
    layer_of = {m.layer: m for m in sim.matches}
    slot_of = slot_id_of(g, sim.matches)
    for sid, info in sim.slots.items():
        if info.kind == "activation":
            name, _ = tens.resolve(sim.plan.tensors[sid])
            qps[sid] = split.activations[name].qparam()
            continue
        layer = sid[: -len(".weight")]
        m = layer_of[layer]
        ref = g.weight_of(m.nodes[m.pattern.weight])
        c = split.const(ref.name)
        perm = _weight_layout(ref.array, c)
        ints = np.ascontiguousarray(np.transpose(c.values, perm))
        axis = None if c.q.axis is None else perm.index(c.q.axis)
        qps[sid] = c.q.qparam(axis)
        values[sid] = ints
        if "bias" in m.nodes:
            b = g.weight_of(m.nodes["bias"])
            bc = split.const(b.name) if b is not None else None
            x = qps[slot_of(m.nodes["data"])]
            acc = (x.scale * qps[sid].scale).astype(np.float32)
            if bc is None:
                notes.append(
                    f"{layer}: the file keeps the bias {b.name if b else '?'!r} in float; "
                    "autoq quantized it (int32, scale input_scale * weight_scale)"
                )
                continue
            ints_b = bc.values.reshape(-1).astype(np.int64)
            bscale = np.broadcast_to(bc.q.scale, ints_b.shape).astype(np.float32)
            bzp = np.broadcast_to(bc.q.zero_point, ints_b.shape).astype(np.int64)
            accb = np.broadcast_to(acc, ints_b.shape)
            if np.any(bzp != 0) or not np.array_equal(bscale, accb):
                # the file's bias has another scale: move it onto the accumulator's grid
                real = (ints_b - bzp).astype(np.float64) * bscale.astype(np.float64)
                ints_b = np.rint(real / accb.astype(np.float64))
                notes.append(
                    f"{layer}: the file's bias {bc.source!r} has scale/zero point different from "
                    "input_scale * weight_scale / 0; rescaled to the accumulator's scale"
                )
            values[f"{layer}.bias"] = np.clip(ints_b, -(2**31), 2**31 - 1).astype(np.int32)
    return _Plan(qps, values, notes)


def _rebuild(
    mod: tvm.IRModule,
    g: Graph,
    fq_of: dict,
    fq_users: dict,
    outputs: list[tuple[str, FileQ | None]],
) -> tvm.IRModule:
    """``g`` as a module again, with fake-quant pairs ``qnn.quantize -> qnn.dequantize``
    (qparams ``fq_of[var]``) read by the bindings ``fq_users[var]`` instead of ``var``, and
    per output ``outputs[k]``: ("raw", None), ("fq", qp) the fake-quantized value, or
    ("int", qp) the quantized integers."""
    w = BindingWriter()
    vmap: dict = {}
    fqvar: dict = {}

    def consts(qp: FileQ):
        return (
            relax.const(np.asarray(qp.scale, np.float32)),
            relax.const(np.asarray(qp.zero_point, np.int32)),
        )

    def emit_fq(v, qp: FileQ):
        s, z = consts(qp)
        q = w.emit(qnn.quantize(v, s, z, out_dtype=qp.dtype))
        return w.emit(qnn.dequantize(q, s, z))

    out_var = g.output if isinstance(g.output, relax.Var) and g.output in g.value else None
    for p in g.inputs:
        if p in fq_of:
            fqvar[p] = emit_fq(p, fq_of[p])
    for var, value in g.bindings:
        if out_var is not None and var.same_as(out_var):
            continue
        local = dict(vmap)
        for u in fqvar:
            if var in fq_users.get(u, ()):
                local[u] = fqvar[u]
        nv = w.emit(remap_expr(value, local), var.name)
        vmap[var] = nv
        if var in fq_of:
            fqvar[var] = emit_fq(nv, fq_of[var])
    new_fields = []
    for e, (kind, qp) in zip(_output_fields(g), outputs, strict=True):
        base = remap_expr(e, vmap)
        if kind == "fq":
            new_fields.append(fqvar[e] if e in fqvar else emit_fq(base, qp))
        elif kind == "int" and qp.dtype == "int32":  # an exact accumulator (unit scale)
            new_fields.append(w.emit(relax.op.astype(base, "int32")))
        elif kind == "int":
            s, z = consts(qp)
            new_fields.append(w.emit(qnn.quantize(base, s, z, out_dtype=qp.dtype)))
        else:
            new_fields.append(base)
    func = w.finish(list(g.inputs) + list(g.weight_params), relax.Tuple(new_fields))
    return with_main(mod, func.with_attr("global_symbol", "main"))


def _finish(mod: tvm.IRModule, split: SplitResult, rounding: str) -> tvm.IRModule:
    """Drop the extra outputs, give integer inputs back their dtype, remove
    ``astype(int32, qnn.dequantize(int32 x, 1.0, 0))``, and propagate/merge again."""
    func = mod["main"]
    w = BindingWriter()
    vmap: dict = {}
    new_value: dict = {}
    params = []
    pre = []
    for p in func.params:
        if p.name in split.int_inputs:
            qp, elem = split.int_inputs[p.name]
            np_dt = _np_dtype(elem).name
            nv = relax.Var(p.name, relax.TensorType(p.ty.shape, np_dt))
            params.append(nv)
            pre.append((p, nv, qp))
        else:
            params.append(p)
    for p, nv, qp in pre:
        s = relax.const(np.asarray(qp.scale, np.float32))
        z = relax.const(np.asarray(qp.zero_point, np.int32))
        vmap[p] = w.emit(qnn.dequantize(nv, s, z))
    pairs = bindings(func)
    values = dict(pairs)
    for var, value in pairs:
        value = remap_expr(value, vmap)
        if (
            isinstance(value, tvm.ir.Call)
            and op_name(value) == "relax.astype"
            and str(value.attrs["dtype"]) == "int32"
        ):
            src = new_value.get(value.args[0])
            if _is_unit_dequantize(src):
                vmap[var] = src.args[0]
                continue
        nv = w.emit(value, var.name)
        new_value[nv] = value
        vmap[var] = nv
    body = func.body.body
    if isinstance(body, relax.Var) and body in values:
        body = values[body]
    fields = list(body.fields) if isinstance(body, relax.Tuple) else [body]
    fields = [remap_expr(f, vmap) for f in fields[: split.n_outputs]]
    result = fields[0] if split.n_outputs == 1 else relax.Tuple(fields)
    new = w.finish(params, result)
    new = relax.analysis.remove_all_unused(new.with_attr("global_symbol", "main"))
    mod = propagate(with_main(mod, new), rounding)
    func = relax.analysis.remove_all_unused(mod["main"])
    out_mod = with_main(mod, func.with_attr("global_symbol", "main"))
    out_mod = relax.transform.EliminateCommonSubexpr()(relax.transform.Normalize()(out_mod))
    return relax.transform.CanonicalizeBindings()(out_mod)


def _is_unit_dequantize(e) -> bool:
    if not (isinstance(e, tvm.ir.Call) and op_name(e) == "qnn.dequantize"):
        return False
    s, z = const_array(e.args[1]), const_array(e.args[2])
    return (
        dtype_of(e.args[0]) == "int32"
        and s is not None
        and z is not None
        and bool(np.all(s == 1.0))
        and bool(np.all(z == 0))
    )


def _merge_fallback(config: Config, ids: dict[str, str]) -> Config:
    fb = config.fallback
    new = Fallback(
        ids=tuple(getattr(fb, "ids", ()))
        + tuple(i for i in ids if i not in getattr(fb, "ids", ())),
        op_types=tuple(getattr(fb, "op_types", ())),
        patterns=tuple(getattr(fb, "patterns", ())),
        validate=bool(getattr(fb, "validate", True)),
    )
    return config.replace(fallback=new)


def import_quantized(
    onnx_model_or_path,
    config: Config | None = None,
    input_shapes: dict | None = None,
    *,
    optimize: bool = True,
) -> tuple[tvm.IRModule, QParams, ImportReport]:
    """Import a quantized ONNX model (QDQ or QOperator) as autoq's canonical int8 module.

    ``onnx_model_or_path``: a path, an ``onnx.ModelProto`` (not modified) or bytes.
    ``config``: patterns, rounding mode (default ``float``) and extra fallback rules; the
    quantization specs and calibrators are not used (the file fixes the qparams).
    ``input_shapes``/``optimize``: as for :func:`autoq.frontends.from_onnx` (the float graph
    is imported with it, batch norms are never folded: the file's weights are final).

    Returns ``(mod, qparams, report)``: the int8 module (``main`` takes the model's inputs
    with their dtypes in the file: an integer input stays integer), the file's qparams as a
    :class:`QParams` (``qparams.values`` holds the integer weights and biases), and an
    :class:`ImportReport`. ``realize(float_mod, params, qparams, config)`` on the
    ``float_mod`` kept in ``report`` reproduces ``mod``.
    """
    from .frontends import from_onnx

    t0 = time.perf_counter()
    report = ImportReport()
    config = config or Config(progress=False)
    model = _load(onnx_model_or_path)
    model, counts = qoperator_to_qdq(model)
    report.rewritten = counts
    report.format = "QOperator" if counts else "QDQ"
    split = split_qdq(model)
    if not split.activations and not split.consts:
        raise QuantizedImportError(
            "the model holds no quantized tensors; use autoq.frontends.from_onnx and autoq.quantize"
        )
    report.activation_tensors = len(split.activations)
    report.weight_tensors = len(split.consts)
    report.timings["parse_s"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    mod, params = from_onnx(split.model, input_shapes, optimize=optimize, fold_bn=False)
    report.timings["tvm_import_s"] = time.perf_counter() - t1
    _bind_params(split, params)

    t2 = time.perf_counter()
    names = _output_names(split)
    fallback: dict[str, str] = {}
    for _ in range(64):
        cfg = _merge_fallback(config, fallback)
        sim = simulate(mod, params, cfg)
        tens = _Tensors(sim.graph, names, split)
        new = {}
        for m in sim.matches:
            reason = _check_match(sim, m, tens, split)
            if reason is not None:
                new[m.layer] = reason
        if not new:
            break
        fallback.update(new)
    report.fallback = dict(fallback)

    # fake-quant pairs where a quantized tensor is read by something that does not quantize it
    g = sim.graph
    covered = {v for m in sim.matches for v in m.covered}
    out_var = g.output if isinstance(g.output, relax.Var) and g.output in g.value else None
    fq_of, fq_users = {}, {}
    for name, var in tens.var.items():
        users = [
            u
            for u in g.users.get(var, [])
            if u not in covered and not (out_var is not None and u.same_as(out_var))
        ]
        if users:
            fq_of[var] = split.activations[name]
            fq_users[var] = set(users)
    fields = _output_fields(g)
    outputs: list[tuple[str, FileQ | None]] = []
    for k, e in enumerate(fields):
        if k in split.int_outputs:
            outputs.append(("int", split.int_outputs[k]))
        elif k in split.dq_outputs:
            qp = split.activations[split.model.graph.output[k].name]
            outputs.append(("fq", qp))
            if isinstance(e, relax.Var):
                fq_of.setdefault(e, qp)
        else:
            outputs.append(("raw", None))
    # the inserted pairs are read only by bindings outside every match and keep every
    # quantized tensor used outside the matches, so realize finds the same matches and slots
    mod_fq = _rebuild(mod, g, fq_of, fq_users, outputs)
    cfg = _merge_fallback(config, fallback)
    plan = _fill(sim, tens, split)
    report.notes += plan.notes
    report.layers = {m.layer: m.pattern.name for m in sim.matches}
    report.float_ops = _float_ops(sim, tens, split)
    meta = {
        "source": "onnx",
        "format": report.format,
        "fallback": dict(fallback),
    }
    if isinstance(onnx_model_or_path, str | os.PathLike):
        meta["file"] = str(onnx_model_or_path)
    qparams = QParams(plan.qparams, dict(sim.slots), meta, plan.values)
    report.timings["slots_s"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    realized = realize(mod_fq, params, qparams, cfg)
    out = _finish(realized, split, cfg.rounding)
    report.timings["realize_s"] = time.perf_counter() - t3
    report.timings["total_s"] = time.perf_counter() - t0
    report.float_mod, report.params, report.config = mod_fq, params, cfg
    return out, qparams, report


def _float_ops(sim: SimResult, tens: _Tensors, split: SplitResult) -> dict[str, str]:
    """ONNX nodes next to quantized tensors that run in fp32 (label -> Relax op)."""
    g = sim.graph
    covered = {v for m in sim.matches for v in m.covered}
    out = {}

    def short(v) -> str:
        return op_name(g.value[v]).removeprefix("relax.")

    def integer(v) -> bool:
        """Runs on integers after realize: in a match, or an allow-list op that propagate
        moves into the integer domain (its output is quantized, or dequantize moves below)."""
        if v in covered or v not in g.value:
            return True
        value = g.value[v]
        if not isinstance(value, tvm.ir.Call) or op_name(value).startswith("qnn."):
            return True
        rule = ALLOW_LIST.get(op_name(value))
        if rule is None or rule.kind != "commute":
            return False
        return rule.dequantize_below or tens.name.get(v) in split.activations

    for name, var in tens.var.items():
        if not integer(var):
            out[split.producer.get(name, name)] = short(var)
        for u in g.users.get(var, []):
            if integer(u):
                continue
            uname = tens.name.get(u)
            label = split.producer.get(uname) if uname else None
            if label is None:
                cons = split.consumers.get(name, [])
                label = cons[0] if len(cons) == 1 else f"a consumer of {name!r}"
            out[label] = short(u)
    return out
