"""Stage 3, which Relax variable holds which quantized ONNX tensor and integer initializer.

TVM's importer drops node names, but outputs survive: :func:`float_module` lays out the
imported module's outputs so that position ``k`` of the output tuple tells which Relax
variable the ``k``-th quantized ONNX tensor became. Those extra outputs stay in the module
until the very end, which also keeps the pattern matcher from fusing across a tensor the
file quantizes (a match may not have a function output inside it): e.g. a file that
quantizes a convolution's output before a residual Add gets ``conv2d_bias`` + ``qnn.add``,
not ``conv2d_bias_add``. The graph outputs the file quantizes or dequantizes become
``qnn.quantize`` / ``qnn.dequantize(qnn.quantize)`` there too: the float module then holds
the file's rounding of its outputs and realize needs nothing else to reproduce them.

Weights are bound by name (:func:`bind_params`): :func:`autoq.frontends.from_onnx` names
parameters by initializer, without the prefixes ONNX Runtime's fusions add.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq import qnn
from autoq.frontends import strip_ort_fusion_prefix
from autoq.importers.file_qparams import FileConst, FileQ, SplitResult
from autoq.ir.allow_list import ALLOW_LIST
from autoq.ir.graph import Graph, WeightRef
from autoq.ir.toolkit import bindings, const, op_name, output_fields, remap_expr, with_main

__all__ = [
    "CLAMPS",
    "FileView",
    "Tensors",
    "bind_params",
    "float_module",
    "main_outputs",
    "on_grid",
    "weight_layout",
]


#: ops whose output the model may quantize in place of their input (:meth:`Tensors.quantized_name`)
CLAMPS = ("relax.nn.relu", "relax.clip")


def main_outputs(func: relax.Function) -> tuple[relax.Var | None, list]:
    """The output fields of ``func`` and the var its output tuple is bound to (None when
    the function returns the tuple, or a single value, directly)."""
    body = func.body.body
    value = dict(bindings(func)).get(body) if isinstance(body, relax.Var) else None
    if isinstance(value, relax.Tuple):
        return body, list(value.fields)
    return None, output_fields(body)


def _graph_outputs(g: Graph) -> list:
    out = g.output
    if isinstance(out, relax.Var) and out in g.value:
        out = g.value[out]
    return output_fields(out)


def on_grid(value) -> bool:
    """Whether the op's output lies on its input's quantization grid (the allow-list rows
    whose dequantize may move below them): a slot there has the input's qparams exactly."""
    if not isinstance(value, tvm.ir.Call):
        return False
    rule = ALLOW_LIST.get(op_name(value))
    if rule is None or rule.kind != "commute" or not rule.dequantize_below:
        return False
    if op_name(value) == "relax.nn.pad":
        return str(value.attrs.pad_mode) == "constant" and float(value.attrs.pad_value) == 0.0
    return True


class Tensors:
    """Which Relax variable of a prepared graph holds which quantized ONNX tensor."""

    def __init__(self, g: Graph, names: list[tuple[int, str]], split: SplitResult):
        self.g, self.split = g, split
        self.var: dict[str, relax.Var] = {}
        self.name: dict[relax.Var, str] = {}
        fields = _graph_outputs(g)
        for pos, name in names:
            e = fields[pos]
            if isinstance(e, relax.Var):
                self.var.setdefault(name, e)
                self.name.setdefault(e, name)

    def resolve(self, var) -> str | None:
        """The quantized ONNX tensor whose grid ``var`` lies on (through on-grid ops)."""
        seen = set()
        while isinstance(var, relax.Var) and var not in seen:
            seen.add(var)
            name = self.name.get(var)
            if name is not None and name in self.split.activations:
                return name
            value = self.g.value.get(var)
            if isinstance(value, relax.Var):
                var = value
            elif on_grid(value) and isinstance(value.args[0], relax.Var):
                var = value.args[0]
            else:
                return None
        return None

    def quantized_name(self, var) -> str | None:
        """:meth:`resolve`, or else the quantized tensor ``var`` reaches through a chain of
        single-user clamps (:data:`CLAMPS`): a file that quantizes ``relu(add(a, b))`` only
        after the relu fixes the add's output grid, exactly (``Q(relu(x)) == max(Q(x), zp)``
        and ``Q(clip(x, lo, hi)) == clip(Q(x), Q(lo), Q(hi))`` with the same qparams)."""
        name, seen = self.resolve(var), set()
        while name is None and isinstance(var, relax.Var) and var not in seen:
            seen.add(var)
            users = self.g.users.get(var, [])
            if len(users) != 1 or op_name(self.g.value.get(users[0])) not in CLAMPS:
                return None
            var = users[0]
            name = self.name.get(var) if self.name.get(var) in self.split.activations else None
        return name

    def describe(self, var) -> str:
        if var in self.name:
            return repr(self.name[var])
        return f"{self.g.ids.get(var)} (not a tensor the model quantizes)"


def bind_params(split: SplitResult, params: dict[str, np.ndarray]) -> dict[str, FileConst]:
    """Which imported weight parameter holds which integer initializer of the file.

    Binding is by name (fusion prefixes and ``onnx::`` stripped) and size; a layer uses the
    integers only if the parameter still holds the file's dequantized values in some layout
    (checked by :func:`weight_layout`)."""

    def strip(name: str) -> str:
        return strip_ort_fusion_prefix(name).removeprefix("onnx::")

    by_stripped: dict[str, list[FileConst]] = defaultdict(list)
    for c in split.consts.values():
        by_stripped[strip(c.name)].append(c)
    out = {}
    for name, arr in params.items():
        c = split.consts.get(name)
        if c is None:
            cands = by_stripped.get(strip(name), [])
            c = cands[0] if len(cands) == 1 else None
        if c is not None and np.asarray(arr).size == c.values.size:
            out[name] = c
    return out


def weight_layout(ref_array: np.ndarray, c: FileConst) -> tuple[int, ...] | None:
    """The permutation taking the file's initializer layout to the graph's weight layout."""
    f = c.dequantized()
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


@dataclass(frozen=True)
class LayerWeight:
    """A layer's weight in the graph, the file's integers for it and the permutation from
    the file's layout to the graph's."""

    ref: WeightRef
    const: FileConst
    perm: tuple[int, ...]


@dataclass
class FileView:
    """The prepared graph seen through the file: its quantized tensors (:class:`Tensors`),
    its integer weights by parameter name, and each layer's weight layout (found once)."""

    tens: Tensors
    by_param: dict[str, FileConst]
    weights: dict[str, LayerWeight] = field(default_factory=dict)

    @property
    def g(self) -> Graph:
        return self.tens.g

    @property
    def split(self) -> SplitResult:
        return self.tens.split

    def const(self, param_name: str | None) -> FileConst | None:
        return self.by_param.get(param_name) if param_name else None

    def inline_const(self, array: np.ndarray) -> FileConst | None:
        """The file's integer initializer behind a constant the importer inlined (TVM's
        ONNX frontend makes scalar initializers, e.g. an attention scale, Relax
        constants): the first one whose dequantized values are ``array`` in some layout
        (any of them gives those same real values)."""
        for c in self.split.consts.values():
            if c.values.size == array.size and weight_layout(array, c) is not None:
                return c
        return None


# --------------------------------------------------------------------- the float module


def _output_plan(split: SplitResult) -> list[tuple[str, FileQ | None, str]]:
    """(kind, qparams, ONNX name) of each original graph output."""
    plan = []
    for k, name in enumerate(split.output_names[: split.n_outputs]):
        if k in split.int_outputs:
            plan.append(("int", split.int_outputs[k], name))
        elif k in split.dq_outputs:
            plan.append(("dq", split.activations[name], name))
        else:
            plan.append(("raw", None, name))
    return plan


def float_module(
    mod: tvm.IRModule, split: SplitResult
) -> tuple[tvm.IRModule, list[tuple[int, str]]]:
    """``mod`` (imported from ``split.model``) with its outputs laid out for the import:
    the original outputs as the file computes them, then one output per quantized tensor.

    Returns the module (its ``main`` returns a tuple directly, no binding does: rounding
    points never apply to an output) and ``(output position, ONNX tensor)`` of every
    position that holds a quantized tensor as it is."""
    func = mod["main"]
    pairs = bindings(func)
    out_var, fields = main_outputs(func)
    bb = relax.BlockBuilder()
    attrs = dict(func.attrs.items()) if func.attrs else None
    with bb.function("main", list(func.params), attrs=attrs):
        vmap: dict = {}
        for var, value in pairs:
            if out_var is None or not var.same_as(out_var):
                vmap[var] = bb.emit(remap_expr(value, vmap), name_hint=var.name)
        fields = [remap_expr(f, vmap) for f in fields]
        new_fields, names, again = [], [], []
        for k, (kind, qp, name) in enumerate(_output_plan(split)):
            new_fields.append(_emit_output(bb, fields[k], kind, qp))
            if name in split.activations:
                (again if kind != "raw" else names).append((k, name))
        for j, name in enumerate(split.extra_outputs):
            new_fields.append(fields[split.n_outputs + j])
            names.append((split.n_outputs + j, name))
        for k, name in again:  # the tensor itself, for the mapping
            names.append((len(new_fields), name))
            new_fields.append(fields[k])
        bb.emit_func_output(relax.Tuple(new_fields))
    return with_main(mod, bb.get()["main"]), names


def _emit_output(bb: relax.BlockBuilder, t, kind: str, qp: FileQ | None):
    if kind == "raw":
        return t
    if kind == "int" and qp.dtype == "int32":  # an exact accumulator (unit scale)
        return bb.emit(relax.op.astype(t, "int32"))
    s, z = const(qp.scale, "float32"), const(qp.zero_point, "int32")
    q = bb.emit(qnn.quantize(t, s, z, out_dtype=qp.dtype))
    return q if kind == "int" else bb.emit(qnn.dequantize(q, s, z))
