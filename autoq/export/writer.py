"""The walk over a realized module's ``main``: every binding goes to the rule of its op
(:data:`autoq.export.qnn_rules.RULES`, :data:`autoq.export.relax_rules.RULES`), which adds
ONNX nodes to the :class:`~autoq.export.graph.Graph` and returns what the binding's value is
there (:class:`Int`, :class:`Float`, :class:`Acc` or a tuple of them).

The helpers below are shared by the rules: constants of the module as initializers,
``DequantizeLinear`` / ``QuantizeLinear`` with autoq's qparams (a one-element scale becomes a
scalar, a longer one a per-axis scale), and :meth:`Writer.rescale`, an accumulator's real
value on the grid a reader names.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper
from tvm import relax

from autoq.errors import ExportError
from autoq.ir.toolkit import bindings, const_array, dtype_of, free_vars, op_name

from .graph import Acc, Float, Graph, Int

__all__ = ["Writer", "attr", "broadcast_along", "value_info"]

_F32 = np.float32
#: autoq's int8 activations are uint8 ``q + SHIFT`` in the ONNX graph (see graph.Int)
SHIFT = 128


def attr(call, key: str, default=None):
    """Attribute ``key`` of a call (a qnn op's dictionary or a Relax op's attrs object) as
    Python data: ints, floats, strings, lists of them."""
    attrs = call.attrs
    if attrs is None:
        return default
    try:
        value = attrs[key] if key in attrs.keys() else default
    except (AttributeError, TypeError):
        value = getattr(attrs, key, default)
    return _plain(value)


def _plain(value):
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "__len__") and not isinstance(value, str):
        return [_plain(v) for v in value]
    for cast in (int, float, str):
        try:
            return cast(value)
        except (TypeError, ValueError):
            continue
    return value


def broadcast_along(arr, axis: int, rank: int) -> np.ndarray:
    """A 0-d / 1-element array as a 0-d one, a 1-D one shaped to broadcast along ``axis`` of
    a rank-``rank`` tensor.

    >>> broadcast_along(np.array([1.0, 2.0]), 1, 4).shape
    (1, 2, 1, 1)
    >>> broadcast_along(np.array([3.0]), 1, 4).shape
    ()
    """
    arr = np.asarray(arr)
    if arr.size == 1:
        return arr.reshape(())
    shape = [1] * rank
    shape[axis] = arr.size
    return arr.reshape(shape)


class Writer:
    """Writes ONNX nodes for the bindings of one realized ``main`` (see the module
    docstring)."""

    def __init__(self, func: relax.Function, rules: dict, module=None):
        self.func = func
        self.module = module
        self.rules = rules
        self.g = Graph()
        self.values: dict = {}
        #: float tensors (Conv outputs on a shifted per-channel input) quantized as int8:
        #: a uint8 ``QuantizeLinear`` of them would make ONNX Runtime fuse ``QLinearConv``,
        #: which refuses the per-channel input zero point at run time
        self.int8_outputs: set[str] = set()
        self.uses = Counter()
        pairs = bindings(func)
        for _, value in pairs:
            for v in free_vars(value):
                self.uses[v] += 1
        for v in free_vars(func.body.body):
            self.uses[v] += 1
        self.pairs = pairs
        self.binding = ""

    # ------------------------------------------------------------------ walking

    def run(self, input_names: list[str]) -> list:
        for param, name in zip(self.func.params, input_names, strict=True):
            self.g.reserve(name)
            dtype = dtype_of(param)
            self.values[param] = Float(name) if dtype == "float32" else Int(name, dtype)
        for var, value in self.pairs:
            self.binding = var.name
            self.values[var] = self.convert(var, value)
        body = self.func.body.body
        fields = list(body.fields) if isinstance(body, relax.Tuple) else [body]
        values = [self.value(f) for f in fields]
        if len(values) == 1 and isinstance(values[0], tuple):  # a var bound to a tuple
            return list(values[0])
        return values

    def convert(self, var, value):
        kind = op_name(value)
        if kind == "get_item":
            return self.value(value.tuple_value)[value.index]
        if kind == "tuple":
            return tuple(self.value(f) for f in value.fields)
        if kind in ("alias", "const"):
            return self.value(value)
        rule = self.rules.get(kind)
        if rule is None:
            raise ExportError(
                f"ONNX export: binding '{var.name}' is the op '{kind}', which the export has "
                "no rule for (docs/export.md lists the ops); use the TVM library "
                "(--format so) for this model, or keep that layer's ops out of the model"
            )
        return rule(self, value, var)

    def value(self, expr):
        """What a call argument is in the ONNX graph (a constant becomes an initializer)."""
        if isinstance(expr, relax.Var):
            return self.values[expr]
        if isinstance(expr, relax.Tuple):
            return tuple(self.value(f) for f in expr.fields)
        arr = const_array(expr)
        if arr is None:
            raise self.error(f"an argument of kind '{op_name(expr)}' is not supported")
        name = self.g.const(arr, hint="const")
        return Float(name) if arr.dtype == np.float32 else Int(name, str(arr.dtype))

    def error(self, what: str) -> ExportError:
        return ExportError(
            f"ONNX export: binding '{self.binding}': {what}; use the TVM library "
            "(--format so) for this model"
        )

    def single_use(self, expr) -> bool:
        return isinstance(expr, relax.Var) and self.uses[expr] == 1

    # ------------------------------------------------------------------ constants

    def array(self, expr, what: str) -> np.ndarray:
        arr = const_array(expr)
        if arr is None:
            raise self.error(f"{what} is not a constant")
        return arr

    def ints(self, values, hint="shape") -> str:
        return self.g.const(np.asarray(values, np.int64).reshape(-1), hint=hint)

    # ------------------------------------------------------------------ Q / DQ

    def _qparams(self, scale, zero_point, dtype: str, axis: int, rank: int):
        scale = np.asarray(scale, _F32)
        zero_point = np.broadcast_to(np.asarray(zero_point), scale.shape)
        attrs = {}
        if scale.size == 1:
            scale, zero_point = scale.reshape(()), zero_point.reshape(-1)[:1].reshape(())
        else:
            scale, zero_point = scale.reshape(-1), zero_point.reshape(-1)
            attrs["axis"] = axis % rank
        s = self.g.const(scale, _F32, hint="scale")
        z = self.g.const(zero_point.astype(dtype), hint="zero_point")
        return s, z, attrs

    def dq(self, value: Int, scale, zero_point, axis: int = -1, rank: int = 1) -> str:
        """``DequantizeLinear`` of an integer tensor with constant qparams."""
        zero_point = np.asarray(zero_point, np.int32) + value.shift
        s, z, attrs = self._qparams(scale, zero_point, value.onnx_dtype, axis, rank)
        return self.g.node("DequantizeLinear", [value.name, s, z], hint="dq", **attrs)

    def q(self, name: str, scale, zero_point, dtype: str, axis: int = -1, rank: int = 1) -> Int:
        """``QuantizeLinear`` of a float tensor with constant qparams."""
        if dtype not in ("int8", "uint8", "int16", "uint16"):
            raise self.error(f"quantizing to {dtype} has no ONNX QuantizeLinear")
        # per-axis grids stay int8: ONNX Runtime fuses DQ -> Conv -> Q with a uint8 output
        # into QLinearConv, which refuses a per-channel output zero point at run time
        per_tensor = np.asarray(scale).size == 1 and name not in self.int8_outputs
        shift = SHIFT if dtype == "int8" and per_tensor else 0
        zero_point = np.asarray(zero_point, np.int32) + shift
        s, z, attrs = self._qparams(scale, zero_point, "uint8" if shift else dtype, axis, rank)
        out = self.g.node("QuantizeLinear", [name, s, z], hint="q", **attrs)
        return Int(out, dtype, shift)

    def unshifted(self, value: Int, dtype: str | None = None) -> str:
        """The tensor of autoq's own integers (as ``dtype``, default autoq's dtype)."""
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype or value.dtype))
        if not value.shift:
            return self.g.node("Cast", [value.name], to=elem) if dtype else value.name
        wide = self.g.node(
            "Cast", [value.name], to=helper.np_dtype_to_tensor_dtype(np.dtype("int32"))
        )
        back = self.g.node("Sub", [wide, self.g.const(np.int32(value.shift), hint="shift")])
        return self.g.node("Cast", [back], to=elem)

    def shifted(self, value: Int) -> Int:
        """An int8 tensor as uint8 ``q + SHIFT`` (the same ``Int``; other tensors unchanged)."""
        if value.dtype != "int8" or value.shift:
            return value
        wide = self.g.node(
            "Cast", [value.name], to=helper.np_dtype_to_tensor_dtype(np.dtype("int32"))
        )
        moved = self.g.node("Add", [wide, self.g.const(np.int32(SHIFT), hint="shift")])
        out = self.g.node("Cast", [moved], to=helper.np_dtype_to_tensor_dtype(np.dtype("uint8")))
        return Int(out, value.dtype, SHIFT)

    def shifted_const(self, arr: np.ndarray, like: Int) -> str:
        """An integer constant in the representation of ``like`` (shifted like it)."""
        return self.g.const((arr.astype(np.int32) + like.shift).astype(like.onnx_dtype))

    def rescale(self, acc: Acc, scale, axis: int) -> str:
        """The accumulator's integers times ``scale`` (along ``axis``): its real value on the
        grid a reader names (the same tensor when the scale is the accumulator's own)."""
        mine = broadcast_along(acc.scale, acc.axis, acc.rank).astype(_F32)
        theirs = broadcast_along(np.asarray(scale, _F32), axis % acc.rank, acc.rank)
        ratio = (theirs / mine).astype(_F32)
        if np.all(ratio == 1):
            return acc.name
        return self.g.node("Mul", [acc.name, self.g.const(ratio, hint="ratio")], hint="rescale")

    def real(self, value, what: str) -> str:
        """The float tensor of a Float (or an accumulator's real value)."""
        if isinstance(value, Float):
            return value.name
        if isinstance(value, Acc):
            return value.name
        raise self.error(f"{what} is an integer tensor where a float one is expected")


def value_info(name: str, ty) -> onnx.ValueInfoProto:
    """The ONNX type of a Relax tensor type (static shape)."""
    try:
        shape, dtype = [int(d) for d in ty.shape.values], str(ty.dtype)
    except (AttributeError, TypeError, ValueError):
        shape = dtype = None
    if shape is None or dtype is None:
        raise ExportError(
            f"ONNX export: '{name}' has no static tensor shape; quantize with fixed input "
            "shapes (--input-shape) to export it"
        )
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(name, elem, list(shape))
