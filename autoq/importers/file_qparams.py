"""Stage 2, the file's quantization: QDQ graph -> float graph + the file's qparams.

``DQ(Q(t))`` becomes ``t`` and the file's (scale, zero point, dtype) of ``t`` is recorded;
``DQ(integer initializer)`` becomes a float initializer named like the weight
(``conv1.weight_quantized`` -> ``conv1.weight``, so autoq's layer ids are the file's weight
names) and the integers, scale, zero point and axis are recorded; int32 biases likewise.
Integer graph inputs become float inputs and integer graph outputs float outputs (converted
back at the end). Every quantized activation tensor is added as an extra graph output, so
that the Relax variable it becomes can be found after import (:mod:`.tensors`).

Scales and zero points must be constants: initializers, ``Constant`` nodes, or ``Identity``
chains of them (see :func:`.onnx_graph.constants`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autoq import primitives as P
from autoq.importers.onnx_graph import (
    INT32_CAST,
    MS_DOMAIN,
    QUANT_DTYPES,
    QuantizedImportError,
    attrs,
    constants,
    is_dequantize,
    is_qdq,
    load,
    node_label,
    np_dtype,
)
from autoq.qparams import QParam

__all__ = ["FileConst", "FileQ", "SplitResult", "qdq_params", "split_qdq"]


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

    def require_same(self, other: FileQ, message: str) -> None:
        """Raise :class:`QuantizedImportError` with ``message`` unless ``other`` is the same."""
        if not self.same(other):
            raise QuantizedImportError(message)

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

    def dequantized(self) -> np.ndarray:
        return P.dequantize(self.values, self.q.scale, self.q.zero_point, self.q.axis)


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
    #: the float graph's output names (the originals, then the extra outputs)
    output_names: list[str] = field(default_factory=list)


def qdq_params(node, consts, in_dtype: str | None) -> FileQ:
    """Constant scale / zero point of a QuantizeLinear or DequantizeLinear node."""
    label = node_label(node)
    at = attrs(node)
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
    tiny = np.finfo(np.float32).tiny
    if not (np.all(np.isfinite(scale)) and np.all(scale >= tiny)):
        raise QuantizedImportError(
            f"{label}: scale {ins[1]!r} = {scale.ravel()[:4].tolist()} is not a usable scale "
            f"(it must be finite and at least {tiny:.4g}, the smallest normal float32): fix "
            "the file's quantization of this tensor"
        )
    if ins[2]:
        zp = np.asarray(consts[ins[2]])
        dtype = zp.dtype.name
    else:
        out_t = at.get("output_dtype", 0) if node.op_type == "QuantizeLinear" else 0
        dtype = np_dtype(out_t).name if out_t else (in_dtype or "uint8")
        zp = np.zeros(scale.shape, np.int64)
    if dtype not in (*QUANT_DTYPES, "int32"):
        raise QuantizedImportError(f"{label}: quantized dtype {dtype} is not supported")
    zp = zp.astype(np.int64)
    if scale.size == 1 and zp.size == 1:
        return FileQ(scale.reshape(()), zp.reshape(()), dtype, None)
    flat = scale.reshape(-1)
    zp = np.broadcast_to(zp.reshape(-1), flat.shape).copy()
    return FileQ(flat, zp, dtype, int(at.get("axis", 1)))


def weight_name(source: str, taken: set[str]) -> str:
    """``conv1.weight_quantized`` -> ``conv1.weight`` (ONNX Runtime's suffix), if free."""
    for suffix in ("_quantized", "_Quantized", "_q", "_int8", "_uint8", "_int32"):
        if source.endswith(suffix) and len(source) > len(suffix):
            base = source[: -len(suffix)]
            if base not in taken:
                return base
    return source


def _float_vi(vi, name: str | None = None):
    """A copy of the value info ``vi`` as float32 (renamed to ``name``)."""
    from onnx import TensorProto, ValueInfoProto

    out = ValueInfoProto()
    out.CopyFrom(vi)
    if name is not None:
        out.name = name
    out.type.tensor_type.elem_type = TensorProto.FLOAT
    return out


class _Splitter:
    """The state of one :func:`split_qdq` (each step is a method, in the order run)."""

    def __init__(self, model):
        self.model, self.graph = model, model.graph
        self.consts = constants(model)
        self.init_names = {t.name for t in self.graph.initializer}
        self.inputs = {i.name: i for i in self.graph.input if i.name not in self.init_names}
        self.nodes = list(self.graph.node)
        self.labels = {id(n): node_label(n, k) for k, n in enumerate(self.nodes)}
        self.all_names = self.init_names | set(self.inputs) | {o.name for o in self.graph.output}
        for n in self.nodes:
            self.all_names |= set(n.input) | set(n.output)
        #: QuantizeLinear output -> (input, qparams, node); folded: constant inputs quantized
        self.q_of: dict[str, tuple[str, FileQ, Any]] = {}
        self.folded: dict[str, np.ndarray] = {}
        self.alias: dict[str, str] = {}
        self.activations: dict[str, FileQ] = {}
        self.fconsts: dict[str, FileConst] = {}
        self.by_source: dict[str, str] = {}
        self.int_inputs: dict[str, tuple[FileQ, int]] = {}
        self.int32_of: dict[str, str] = {}
        self.new_inits: list = []
        #: Cast nodes of quantized integers to their own dtype (dropped)
        self.noop_casts: set[int] = set()

    def resolve(self, t: str) -> str:
        seen = set()
        while t in self.alias and t not in seen:
            seen.add(t)
            t = self.alias[t]
        return t

    def in_dtype(self, name: str) -> str | None:
        if name in self.consts:
            return np.asarray(self.consts[name]).dtype.name
        if name in self.inputs:
            return np_dtype(self.inputs[name].type.tensor_type.elem_type).name
        if name in self.q_of:
            return self.q_of[name][1].dtype
        return None

    def record_act(self, t: str, qp: FileQ, where: str) -> None:
        if qp.scale.ndim != 0:
            raise QuantizedImportError(
                f"{where}: per-axis quantization of the activation {t!r} is not supported"
            )
        if t in self.activations and not self.activations[t].same(qp):
            raise QuantizedImportError(
                f"{where}: the tensor {t!r} is quantized twice with different qparams"
            )
        self.activations[t] = qp

    # ---- QuantizeLinear / DequantizeLinear
    def read_quantize_nodes(self) -> None:
        for n in self.nodes:
            if not (is_qdq(n) and n.op_type == "QuantizeLinear"):
                continue
            qp = qdq_params(n, self.consts, None)
            self.q_of[n.output[0]] = (n.input[0], qp, n)
            src = self.consts.get(n.input[0])
            if src is not None and src.dtype.kind == "f":
                axis = None if qp.axis is None else qp.axis % src.ndim
                self.folded[n.output[0]] = P.quantize(src, qp.scale, qp.zero_point, qp.dtype, axis)
        for n in self.nodes:  # torch's export: Cast(QuantizeLinear) to the same dtype
            if n.op_type == "Cast" and n.input[0] in self.q_of and n.input[0] not in self.folded:
                if np_dtype(int(attrs(n)["to"])).name == self.q_of[n.input[0]][1].dtype:
                    self.q_of[n.output[0]] = self.q_of[n.input[0]]
                    self.noop_casts.add(id(n))

    def read_dequantize(self, n) -> None:
        a, out, where = n.input[0], n.output[0], self.labels[id(n)]
        qp = qdq_params(n, self.consts, self.in_dtype(a))
        integer = a in self.consts and self.consts[a].dtype.name in (*QUANT_DTYPES, "int32")
        if a in self.q_of and a not in self.folded:
            t, qq, qnode = self.q_of[a]
            t = self.resolve(t)  # Q(DQ(...)): a requantization shows up as a second qparams
            if not qp.same(qq):
                raise QuantizedImportError(
                    f"{where} dequantizes {a!r} with other qparams than {self.labels[id(qnode)]} "
                    "quantized it (a requantization); not supported"
                )
            self.record_act(t, qp, where)
            self.alias[out] = t
        elif a in self.folded or integer:
            self.alias[out] = self.integer_const(a, out, qp, where)
        elif a in self.inputs and self.in_dtype(a) in QUANT_DTYPES:
            self.record_act(a, qp, where)
            if a in self.int_inputs and not self.int_inputs[a][0].same(qp):
                raise QuantizedImportError(
                    f"{where}: the input {a!r} is dequantized with two qparams"
                )
            self.int_inputs[a] = (qp, self.inputs[a].type.tensor_type.elem_type)
            self.alias[out] = a
        else:
            raise QuantizedImportError(
                f"{where} dequantizes {a!r}, which is neither a QuantizeLinear output, an integer "
                "initializer nor an integer graph input: not supported"
            )

    def integer_const(self, a: str, out: str, qp: FileQ, where: str) -> str:
        """``DQ(a)`` of integer constants ``a``: the name of the float initializer holding
        its values (one per integer tensor), recorded as a :class:`FileConst`."""
        from onnx import numpy_helper

        if a in self.by_source:
            prev = self.fconsts[self.by_source[a]]
            prev.q.require_same(
                qp, f"{where}: the integer initializer {a!r} is dequantized with two qparams"
            )
            return prev.name
        ints = self.folded[a] if a in self.folded else np.asarray(self.consts[a])
        source = self.q_of[a][0] if a in self.folded else a
        axis = None if qp.axis is None else qp.axis % max(ints.ndim, 1)
        qp = FileQ(qp.scale, qp.zero_point, qp.dtype, axis)
        name = weight_name(source, self.all_names - {out})
        if name != source and name != out:
            self.all_names.add(name)
        c = FileConst(name, source, np.ascontiguousarray(ints), qp)
        self.fconsts[name] = c
        self.by_source[a] = name
        self.new_inits.append(numpy_helper.from_array(c.dequantized().astype(np.float32), name))
        return name

    def check_quantize_consumers(self) -> None:
        """QuantizeLinear outputs may feed only DequantizeLinear nodes and graph outputs."""
        for n in self.nodes:
            if is_qdq(n) or id(n) in self.noop_casts:
                continue
            for i in n.input:
                if i in self.q_of:
                    raise QuantizedImportError(
                        f"{self.labels[id(n)]} reads the quantized integers {i!r} directly; only "
                        "DequantizeLinear may (run qoperator_to_qdq first for QOperator models)"
                    )

    def int32_casts(self) -> None:
        """ConvInteger / MatMulInteger outputs: the float op's integer-valued result."""
        for n in self.nodes:
            if n.op_type == "Cast" and n.name.startswith(INT32_CAST):
                self.int32_of[n.output[0]] = n.input[0]
                self.alias[n.output[0]] = n.input[0]

    # ---- the float graph
    def rewire(self) -> tuple[list, dict[str, str], dict[str, list[str]]]:
        """The kept (float) nodes reading resolved names; producer and consumer labels."""
        kept = [
            n
            for n in self.nodes
            if not is_qdq(n) and n.output[0] not in self.int32_of and id(n) not in self.noop_casts
        ]
        producer: dict[str, str] = {}
        consumers: dict[str, list[str]] = defaultdict(list)
        for n in kept:
            new_in = [self.resolve(i) if i else i for i in n.input]
            del n.input[:]
            n.input.extend(new_in)
            for o in n.output:
                producer[o] = self.labels[id(n)]
            for i in set(new_in):
                if i:
                    consumers[i].append(self.labels[id(n)])
        return kept, producer, dict(consumers)

    def outputs(self) -> tuple[list, dict[int, FileQ], set[int]]:
        """The float graph outputs, the integer ones (with qparams) and the dequantized ones."""
        new_outputs, int_outputs, dq_outputs = [], {}, set()
        for k, o in enumerate(self.graph.output):
            if o.name in self.int32_of:
                int_outputs[k] = FileQ(np.float32(1.0), np.int64(0), "int32")
            elif o.name in self.alias:
                dq_outputs.add(k)
            elif o.name in self.q_of:
                t, qp, _ = self.q_of[o.name]
                int_outputs[k] = qp
                self.record_act(self.resolve(t), qp, f"graph output {o.name!r}")
            else:
                new_outputs.append(o)
                continue
            name = self.resolve(self.q_of[o.name][0] if o.name in self.q_of else o.name)
            new_outputs.append(_float_vi(o, name))
        return new_outputs, int_outputs, dq_outputs

    def drop_unused(self, kept: list, outputs: set[str]) -> tuple[list, list]:
        """Kept nodes and initializers without what nobody reads any more (integer weights,
        scales, zero points, and the Constant/Identity/Cast nodes that held them; a Constant
        node holding integer weights gives way to the float initializer of the same name)."""
        while True:
            used = {i for n in kept for i in n.input} | outputs
            live = [
                n
                for n in kept
                if n.op_type not in ("Constant", "Identity", "Cast", "ConstantOfShape")
                or n.domain not in ("", "ai.onnx")
                or any(o in used and o not in self.fconsts for o in n.output)
            ]
            if len(live) == len(kept):
                break
            kept = live
        inits = [t for t in self.graph.initializer if t.name in used and t.name not in self.fconsts]
        inits += [t for t in self.new_inits if t.name in used]
        for name in [k for k in self.fconsts if k not in used]:
            del self.fconsts[name]
        return kept, inits

    def float_inputs(self) -> list:
        # old models list initializers as inputs too: those are dropped
        return [
            _float_vi(i) if i.name in self.int_inputs else i
            for i in self.graph.input
            if i.name not in self.init_names
        ]

    def extras(self, outputs: list) -> list[str]:
        """Every quantized activation that is not a graph output yet (appended as one)."""
        from onnx import TensorProto, helper

        present = {o.name for o in outputs}
        names = [t for t in self.activations if t not in present]
        outputs += [helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in names]
        return names


def _replace(container, items) -> None:
    del container[:]
    container.extend(items)


def split_qdq(model, extra_outputs: bool = True) -> SplitResult:
    """The float graph of a QDQ model plus the file's quantization (module doc)."""
    model = load(model)
    s = _Splitter(model)
    s.read_quantize_nodes()
    for n in s.nodes:
        if is_dequantize(n):
            s.read_dequantize(n)
    s.check_quantize_consumers()
    s.int32_casts()
    kept, producer, consumers = s.rewire()
    outputs, int_outputs, dq_outputs = s.outputs()
    kept, inits = s.drop_unused(kept, {o.name for o in outputs})
    inputs = s.float_inputs()
    n_outputs = len(outputs)
    extras = s.extras(outputs) if extra_outputs else []
    graph = model.graph
    _replace(graph.node, kept)
    _replace(graph.initializer, inits)
    _replace(graph.input, inputs)
    _replace(graph.output, outputs)
    del graph.value_info[:]
    if not any(n.domain == MS_DOMAIN for n in kept):
        _replace(model.opset_import, [o for o in model.opset_import if o.domain != MS_DOMAIN])
    return SplitResult(
        model,
        n_outputs,
        extras,
        s.activations,
        s.fconsts,
        s.int_inputs,
        int_outputs,
        dq_outputs,
        producer,
        consumers,
        [o.name for o in graph.output],
    )
