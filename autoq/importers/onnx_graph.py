"""ONNX graph reading shared by the import stages: constants (through Identity chains), node
labels and kinds, fresh names, and the error every stage raises."""

from __future__ import annotations

from typing import Any

import numpy as np

from autoq.errors import InputError
from autoq.frontends import load_onnx

__all__ = [
    "INT32_CAST",
    "MS_DOMAIN",
    "QOPERATOR_OPS",
    "QUANT_DTYPES",
    "FreshNames",
    "QuantizedImportError",
    "attrs",
    "constants",
    "default_opset",
    "is_dequantize",
    "is_qdq",
    "is_qoperator",
    "is_quantized_onnx",
    "load",
    "node_label",
    "np_dtype",
    "same_values",
    "zero_point",
]


class QuantizedImportError(InputError):
    """The quantized file uses something the importer cannot represent exactly (an
    :class:`autoq.errors.InputError`, so a ``ValueError``)."""


MS_DOMAIN = "com.microsoft"
_DEFAULT_DOMAINS = ("", "ai.onnx")
_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
#: QOperator op types (default and com.microsoft domains) that qoperator_to_qdq rewrites
QOPERATOR_OPS = (
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
QUANT_DTYPES = ("int8", "uint8", "int16", "uint16")
#: name prefix of the Cast that qoperator_to_qdq puts after ConvInteger/MatMulInteger
INT32_CAST = "autoq/int32_accumulator/"


def load(path_or_model):
    """A copy of the model (path, ModelProto or bytes): the caller's model is not modified."""
    return load_onnx(path_or_model, caller="import_quantized")


def np_dtype(elem_type: int) -> np.dtype:
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _constant_value(node) -> np.ndarray | None:
    from onnx import numpy_helper

    for name, v in attrs(node).items():
        if name == "value":
            return numpy_helper.to_array(v)
        if name in ("value_float", "value_int", "value_floats", "value_ints"):
            return np.asarray(v, np.float32 if "float" in name else np.int64)
    return None


def _cast(node, value: np.ndarray) -> np.ndarray:
    return value.astype(np_dtype(int(attrs(node)["to"])))


def _constant_of_shape(node, shape: np.ndarray) -> np.ndarray:
    v = _constant_value(node)
    fill = v.reshape(-1)[0] if v is not None else np.float32(0)
    return np.full(tuple(int(d) for d in shape.reshape(-1)), fill, dtype=np.asarray(fill).dtype)


#: op type -> value of a node whose inputs are all constants (torch exports compute zero
#: points and biases' zero points as Cast(ConstantOfShape(shape)))
_CONSTANT_FOLDS = {
    "Identity": lambda node, x: x,
    "Cast": _cast,
    "ConstantOfShape": _constant_of_shape,
}


def constants(model) -> dict[str, np.ndarray]:
    """Initializers, Constant node values and what ``Identity`` / ``Cast`` /
    ``ConstantOfShape`` compute from them, by name.

    Exporters write scales and zero points as ``Identity(initializer)`` (torch FX),
    ``Constant`` nodes or ``Cast(ConstantOfShape(shape))`` (torch's quantized-op export);
    all are constants, not values computed at run time."""
    from onnx import numpy_helper

    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:  # topological order: one pass resolves a chain
        if node.domain not in _DEFAULT_DOMAINS or not node.output:
            continue
        if node.op_type == "Constant":
            value = _constant_value(node)
            if value is not None:
                out[node.output[0]] = value
        elif node.op_type in _CONSTANT_FOLDS and len(node.input) == 1 and node.input[0] in out:
            out[node.output[0]] = np.asarray(
                _CONSTANT_FOLDS[node.op_type](node, out[node.input[0]])
            )
    return out


def node_label(node, k: int | None = None) -> str:
    name = node.name or (f"{node.op_type}#{k}" if k is not None else node.output[0])
    return f"{name} ({node.op_type})"


def is_qoperator(node) -> bool:
    return node.op_type in QOPERATOR_OPS and node.domain in (*_DEFAULT_DOMAINS, MS_DOMAIN)


def is_qdq(node) -> bool:
    return node.op_type in _QDQ_OPS and node.domain in (*_DEFAULT_DOMAINS, MS_DOMAIN)


def is_dequantize(node) -> bool:
    return is_qdq(node) and node.op_type == "DequantizeLinear"


def is_quantized_onnx(path_or_model) -> bool:
    """Whether an ONNX model holds QuantizeLinear/DequantizeLinear or QOperator nodes."""
    model = load(path_or_model)
    return any(is_qdq(n) or is_qoperator(n) for n in model.graph.node)


def default_opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), 0)


def zero_point(consts: dict[str, np.ndarray], name: str | None) -> np.ndarray:
    """The int64 zero point stored under ``name`` (0 when the input is absent)."""
    return np.zeros((), np.int64) if not name else np.asarray(consts[name]).astype(np.int64)


def same_values(a, b) -> bool:
    """Whether two scales or zero points hold the same values (a scalar equals a 1-element
    array)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.size == 1 and b.size == 1:
        return bool(a.reshape(()).astype(np.float64) == b.reshape(()).astype(np.float64))
    return a.shape == b.shape and bool(np.all(a.astype(np.float64) == b.astype(np.float64)))


class FreshNames:
    """Tensor names not used anywhere in a model yet."""

    def __init__(self, model):
        g = model.graph
        self.taken = {t.name for t in g.initializer}
        self.taken |= {i.name for i in g.input} | {o.name for o in g.output}
        for n in g.node:
            self.taken |= set(n.input) | set(n.output)

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name = f"{base}_{k}"
            k += 1
        self.taken.add(name)
        return name
