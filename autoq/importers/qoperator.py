"""Stage 1, QOperator -> QDQ: every QOperator node becomes DequantizeLinear on its integer
inputs, the float op, and QuantizeLinear on its output, so one path imports both formats.

The rewrite of each op type is one rule in :data:`TABLE` (op type -> function). Integer
data-movement ops between QOperator nodes (MaxPool, Reshape, Flatten, Transpose, Pad,
Resize, ... :data:`INT_PASSTHROUGH`) become DequantizeLinear -> op -> QuantizeLinear with
their input's qparams. Integer tensors keep their names: a node producing ``y`` becomes the
float op producing ``y/float`` and ``QuantizeLinear(y/float) -> y``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from autoq.importers.onnx_graph import (
    INT32_CAST,
    QUANT_DTYPES,
    FreshNames,
    QuantizedImportError,
    attrs,
    constants,
    default_opset,
    is_dequantize,
    is_qdq,
    is_qoperator,
    load,
    node_label,
    np_dtype,
    same_values,
    zero_point,
)

__all__ = ["INT_PASSTHROUGH", "TABLE", "qoperator_to_qdq"]

#: integer ops that only move or select values: output qparams = input qparams
INT_PASSTHROUGH = (
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

#: (scale name, zero point name or None) of one quantization
QNames = tuple[str, str | None]


class Rewriter:
    """The state of one rewrite: constants, fresh names, the new nodes and initializers, and
    the (scale, zero point) names every integer tensor was quantized with."""

    def __init__(self, model):
        self.model = model
        self.consts = constants(model)
        self.names = FreshNames(model)
        self.opset = default_opset(model)
        self.nodes: list = []
        self.inits: list = []
        self.qinfo: dict[str, QNames] = {}
        self._dq_cache: dict[tuple, str] = {}
        self.int_inputs = {
            i.name
            for i in model.graph.input
            if i.name not in self.consts
            and np_dtype(i.type.tensor_type.elem_type).name in QUANT_DTYPES
        }

    # ---- building blocks
    def node(self, op: str, inputs: list[str], outputs: list[str], **kw) -> None:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, **kw))

    def const(self, base: str, value) -> str:
        from onnx import numpy_helper

        name = self.names.fresh(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        self.consts[name] = np.asarray(value)
        return name

    def need_const(self, name: str | None, what: str, node) -> np.ndarray | None:
        if not name:
            return None
        if name not in self.consts:
            raise QuantizedImportError(
                f"{node_label(node)}: {what} {name!r} is computed at run time; only constant "
                "scales and zero points can be imported (dynamic quantization is not supported)"
            )
        return self.consts[name]

    def is_int(self, name: str) -> bool:
        return name in self.qinfo or name in self.int_inputs

    def same_qparams(self, a: QNames, b: QNames) -> bool:
        """Whether the (scale, zero point) names ``a`` and ``b`` hold the same values."""
        c = self.consts
        return same_values(c[a[0]], c[b[0]]) and same_values(
            zero_point(c, a[1]), zero_point(c, b[1])
        )

    def per_axis(self, s: str, z: str | None, node) -> bool:
        """Whether the constant scale ``s`` / zero point ``z`` hold more than one value."""
        zp = self.need_const(z, "zero point", node)
        zsize = 1 if zp is None else np.asarray(zp).size
        return max(np.asarray(self.need_const(s, "scale", node)).size, zsize) > 1

    # ---- dequantize / quantize
    def dq(self, q: str, s: str, z: str | None, node, axis: int | None = None) -> str:
        """The float tensor ``DequantizeLinear(q, s, z)`` (one node per distinct key)."""
        self.need_const(s, "scale", node)
        self.need_const(z, "zero point", node)
        key = (q, s, z or None, axis)
        if key not in self._dq_cache:
            out = self.names.fresh(f"{q}/dequantized")
            kw = {} if axis is None else {"axis": axis}
            self.node("DequantizeLinear", [q, s] + ([z] if z else []), [out], **kw)
            self._dq_cache[key] = out
        return self._dq_cache[key]

    def quant(self, f: str, s: str, z: str | None, out: str, node) -> None:
        """``out = QuantizeLinear(f, s, z)`` (per-tensor)."""
        self.need_const(s, "scale", node)
        self.need_const(z, "zero point", node)
        if np.asarray(self.consts[s]).size != 1:
            raise QuantizedImportError(
                f"{node_label(node)}: per-axis output quantization is not supported"
            )
        self.node("QuantizeLinear", [f, s] + ([z] if z else []), [out])
        self.qinfo[out] = (s, z or None)

    def check_same_qparams(self, q: str, s: str, z: str | None, node) -> None:
        if q in self.qinfo:
            s0, z0 = self.qinfo[q]
            if not self.same_qparams((s0, z0), (s, z)):
                raise QuantizedImportError(
                    f"{node_label(node)} reads {q!r} with scale/zero point {s!r}/{z!r}, but it "
                    f"was quantized with {s0!r}/{z0!r}: a requantization inside a QOperator "
                    "node is not supported"
                )
        elif q in self.int_inputs:
            self.qinfo[q] = (s, z or None)

    def act_dq(self, q: str, s: str, z: str | None, node) -> str:
        """DQ of an activation operand (per-tensor; a constant operand may be per-axis 0)."""
        if q in self.consts:
            return self.dq(q, s, z, node, 0 if self.per_axis(s, z, node) else None)
        if self.per_axis(s, z, node):
            raise QuantizedImportError(
                f"{node_label(node)}: per-axis quantization of an activation is not supported"
            )
        self.check_same_qparams(q, s, z, node)
        return self.dq(q, s, z, node)

    def weight_dq(self, w: str, s: str, z: str | None, node, axis: int) -> str:
        if w not in self.consts:
            return self.act_dq(w, s, z, node)
        return self.dq(w, s, z, node, axis if self.per_axis(s, z, node) else None)

    def bias_dq(self, b: str, xs: str, ws: str, node) -> str:
        """DQ of an int32 bias with scale ``x_scale * w_scale``."""
        if b not in self.consts:
            raise QuantizedImportError(f"{node_label(node)}: bias {b!r} is not a constant")
        scale = self.need_const(xs, "scale", node) * self.need_const(ws, "scale", node)
        s = self.const(f"{b}_scale", np.asarray(scale, np.float32))
        return self.dq(b, s, None, node, 0 if np.asarray(scale).size > 1 else None)

    def float_op(self, op: str, inputs: list[str], node, ys: str, yz: str | None, **kw) -> None:
        """The float op ``op`` replacing ``node`` and the QuantizeLinear of its output."""
        y = node.output[0]
        yf = self.names.fresh(f"{y}/float")
        self.node(op, inputs, [yf], name=node.name, **kw)
        self.quant(yf, ys, yz, y, node)

    # ---- integer data movement
    def passthrough(self, node, k: int) -> None:
        """DequantizeLinear -> ``node`` -> QuantizeLinear with its first integer input's qparams."""
        op = node.op_type
        if op not in INT_PASSTHROUGH or node.domain not in ("", "ai.onnx"):
            raise QuantizedImportError(
                f"{node_label(node, k)} computes on quantized integers; only QLinear*/QDQ ops "
                f"and data movement ({', '.join(INT_PASSTHROUGH)}) are supported there"
            )
        first = next(i for i in node.input if self.is_int(i))
        if first not in self.qinfo:
            self.qinfo[first] = input_qparams_from_consumers(self.model, first)
        s, z = self.qinfo[first]
        new_in = [self._passthrough_input(node, k, pos, (s, z)) for pos in range(len(node.input))]
        outs = [self.names.fresh(f"{o}/float") for o in node.output]
        name = node.name or f"{op}#{k}"
        self.node(op, new_in, outs, name=name, domain=node.domain, **attrs(node))
        for o, f in zip(node.output, outs, strict=True):
            self.quant(f, s, z, o, node)

    def _passthrough_input(self, node, k: int, pos: int, sz: QNames) -> str:
        i, op = node.input[pos], node.op_type
        if self.is_int(i):
            self.qinfo.setdefault(i, sz)
            if op == "Concat" and not self.same_qparams(self.qinfo[i], sz):
                raise QuantizedImportError(
                    f"{node_label(node, k)}: Concat of integer tensors with different qparams"
                )
            return self.dq(i, *self.qinfo[i], node)
        bound = (op == "Clip" and pos in (1, 2)) or (op == "Pad" and pos == 2)
        if bound and i in self.consts and self.consts[i].dtype.name in QUANT_DTYPES:
            # an integer bound / pad value: the real value it stands for
            s, z = sz
            centered = self.consts[i].astype(np.float64) - zero_point(self.consts, z)
            real = centered * self.consts[s]
            return self.const(f"{i}/float", real.astype(np.float32))
        return i

    def run(self) -> dict[str, int]:
        """Rewrite the graph in place; returns the number of rewritten nodes per op type."""
        counts: Counter = Counter()
        for k, node in enumerate(self.model.graph.node):
            op = node.op_type
            if is_qdq(node):
                if op == "QuantizeLinear" and node.output[0]:
                    ins = [*node.input, "", ""]
                    self.qinfo[node.output[0]] = (ins[1], ins[2] or None)
                self.nodes.append(node)
            elif not is_qoperator(node):
                if any(self.is_int(i) for i in node.input):
                    self.passthrough(node, k)
                else:
                    self.nodes.append(node)
            else:
                counts[op] += 1
                if not node.name:  # the float op is reported under the QOperator node's label
                    node.name = f"{op}#{k}"
                TABLE[op](self, node, list(node.input) + [""] * 10)
        graph = self.model.graph
        del graph.node[:]
        graph.node.extend(self.nodes)
        graph.initializer.extend(self.inits)
        return dict(counts)


# -------------------------------------------------------------------------- the rules


def copy_attrs(node, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: v for k, v in attrs(node).items() if k not in drop}


def _qlinear_conv(rw: Rewriter, node, ins: list[str]) -> None:
    x, xs, xz, w, ws, wz, ys, yz, b = ins[:9]
    fin = [rw.act_dq(x, xs, xz, node), rw.weight_dq(w, ws, wz, node, 0)]
    if b:
        fin.append(rw.bias_dq(b, xs, ws, node))
    rw.float_op("Conv", fin, node, ys, yz, **copy_attrs(node))


def _qlinear_matmul(rw: Rewriter, node, ins: list[str]) -> None:
    a, as_, az, b, bs, bz, ys, yz = ins[:8]
    rank_b = rw.consts[b].ndim if b in rw.consts else 2
    fin = [rw.act_dq(a, as_, az, node), rw.weight_dq(b, bs, bz, node, rank_b - 1)]
    rw.float_op("MatMul", fin, node, ys, yz)


def _qgemm(rw: Rewriter, node, ins: list[str]) -> None:
    a, as_, az, b, bs, bz, c, ys, yz = ins[:9]
    at = attrs(node)
    if float(at.get("alpha", 1.0)) != 1.0:
        raise QuantizedImportError(f"{node_label(node)}: QGemm with alpha != 1 is not supported")
    trans_b = int(at.get("transB", 0))
    fin = [rw.act_dq(a, as_, az, node), rw.weight_dq(b, bs, bz, node, 0 if trans_b else 1)]
    if c:
        fin.append(rw.bias_dq(c, as_, bs, node))
    kw = copy_attrs(node, ("alpha",))
    if ys:
        rw.float_op("Gemm", fin, node, ys, yz, **kw)
    else:  # no output scale: QGemm outputs float
        rw.node("Gemm", fin, [node.output[0]], name=node.name, **kw)


def _qlinear_binary(rw: Rewriter, node, ins: list[str]) -> None:
    a, as_, az, b, bs, bz, ys, yz = ins[:8]
    fin = [rw.act_dq(a, as_, az, node), rw.act_dq(b, bs, bz, node)]
    rw.float_op(node.op_type.removeprefix("QLinear"), fin, node, ys, yz)


def _qlinear_concat(rw: Rewriter, node, ins: list[str]) -> None:
    ys, yz = ins[0], ins[1]
    trip = list(node.input[2:])
    fin = [rw.act_dq(trip[i], trip[i + 1], trip[i + 2], node) for i in range(0, len(trip), 3)]
    rw.float_op("Concat", fin, node, ys, yz, **copy_attrs(node))


#: QOperator unary op (X, x_scale, x_zp, y_scale, y_zp) -> its float op
UNARY = {
    "QLinearGlobalAveragePool": "GlobalAveragePool",
    "QLinearAveragePool": "AveragePool",
    "QLinearSigmoid": "Sigmoid",
    "QLinearLeakyRelu": "LeakyRelu",
    "QLinearSoftmax": "Softmax",
    "QLinearReduceMean": "ReduceMean",
}


def _qlinear_unary(rw: Rewriter, node, ins: list[str]) -> None:
    x, xs, xz, ys, yz = ins[:5]
    if int(attrs(node).get("channels_last", 0)):
        raise QuantizedImportError(f"{node_label(node)}: channels_last=1 is not supported")
    core = UNARY[node.op_type]
    kw = copy_attrs(node, ("channels_last", "opset"))
    fin = [rw.act_dq(x, xs, xz, node)]
    if core == "ReduceMean" and rw.opset >= 18 and "axes" in kw:
        fin.append(rw.const(f"{node.output[0]}/axes", np.asarray(kw.pop("axes"), np.int64)))
    rw.float_op(core, fin, node, ys, yz, **kw)


def _integer_input(rw: Rewriter, node, x: str, xz: str | None, one: str) -> str:
    """DQ (scale 1) of the data input of ConvInteger/MatMulInteger."""
    if x in rw.qinfo and not same_values(rw.consts[rw.qinfo[x][0]], np.float32(1.0)):
        raise QuantizedImportError(
            f"{node_label(node)}: its input {x!r} was quantized with a scale other than 1; "
            "ConvInteger/MatMulInteger after a static QuantizeLinear is not supported"
        )
    if xz and np.asarray(rw.consts.get(xz, 0)).size > 1:
        raise QuantizedImportError(
            f"{node_label(node)}: per-row input zero points are not supported"
        )
    if x in rw.int_inputs and x not in rw.qinfo:
        rw.qinfo[x] = (one, xz or None)
    return rw.dq(x, one, xz, node)


def _integer_weight(rw: Rewriter, node, w: str, wz: str | None, one: str) -> str:
    """DQ (scale 1, per-axis when the zero point is) of the second ConvInteger/MatMulInteger
    operand."""
    if w in rw.consts:
        wsize = np.asarray(rw.consts[wz]).size if wz else 1
        if wsize == 1:
            return rw.dq(w, one, wz, node)
        axis = 0 if node.op_type == "ConvInteger" else rw.consts[w].ndim - 1
        return rw.dq(w, rw.const("unit_scales", np.ones(wsize, np.float32)), wz, node, axis)
    if wz and np.asarray(rw.consts[wz]).size > 1:
        raise QuantizedImportError(f"{node_label(node)}: per-axis zero points of an activation")
    if w in rw.int_inputs and w not in rw.qinfo:
        rw.qinfo[w] = (one, wz or None)
    return rw.dq(w, one, wz, node)


def _integer_op(rw: Rewriter, node, ins: list[str]) -> None:
    """ConvInteger / MatMulInteger: the float op on unit-scale DQs, then a Cast to int32 that
    split_qdq recognizes by its name (the exact integer accumulator)."""
    from onnx import TensorProto

    x, w, xz, wz = ins[:4]
    one = rw.const("unit_scale", np.float32(1.0))
    fin = [_integer_input(rw, node, x, xz, one), _integer_weight(rw, node, w, wz, one)]
    y = node.output[0]
    yf = rw.names.fresh(f"{y}/float")
    core = "Conv" if node.op_type == "ConvInteger" else "MatMul"
    rw.node(core, fin, [yf], name=node.name, **copy_attrs(node))
    rw.node("Cast", [yf], [y], name=rw.names.fresh(f"{INT32_CAST}{y}"), to=TensorProto.INT32)


Rule = Callable[[Rewriter, Any, list[str]], None]
#: QOperator op type -> the rule that rewrites one node of it
TABLE: dict[str, Rule] = {
    "QLinearConv": _qlinear_conv,
    "QLinearMatMul": _qlinear_matmul,
    "ConvInteger": _integer_op,
    "MatMulInteger": _integer_op,
    "QGemm": _qgemm,
    "QLinearAdd": _qlinear_binary,
    "QLinearMul": _qlinear_binary,
    "QLinearConcat": _qlinear_concat,
    **dict.fromkeys(UNARY, _qlinear_unary),
}


def qoperator_to_qdq(model) -> tuple[Any, dict[str, int]]:
    """Rewrite every QOperator node of ``model`` (a copy is returned) into QDQ form.

    Returns ``(model, counts)`` with the number of rewritten nodes per op type (module doc).
    """
    model = load(model)
    if not any(is_qoperator(n) for n in model.graph.node):
        return model, {}
    return model, Rewriter(model).run()


def input_qparams_from_consumers(model, name: str) -> QNames:
    """Qparams of an integer graph input that first passes data-movement ops: the scale and
    zero point the first QLinear/DequantizeLinear consumer downstream reads it with."""
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    todo, seen = deque([name]), set()
    while todo:
        t = todo.popleft()
        if t in seen:
            continue
        seen.add(t)
        for n in consumers.get(t, []):
            ins = [*n.input, "", "", ""]
            if is_dequantize(n):
                return ins[1], ins[2] or None
            if is_qoperator(n) and n.op_type not in ("ConvInteger", "MatMulInteger"):
                # every QLinear* operand is followed by its scale and zero point
                pos = ins.index(t)
                return ins[pos + 1], ins[pos + 2] or None
            if n.op_type in INT_PASSTHROUGH:
                todo.extend(n.output)
    raise QuantizedImportError(
        f"cannot tell the qparams of the integer input {name!r}: no QLinear or DequantizeLinear "
        "consumer reads it"
    )
