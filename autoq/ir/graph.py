"""The binding-level view of a model that matching and rewriting work on.

:func:`prepare` normalizes ``mod["main"]`` (one function, bindings in topological order) and
returns a :class:`Graph`: the bindings, their users, which values are weights (named
parameters, constants, and data-movement ops over them such as ``permute_dims(fc.weight)``,
evaluated in numpy), and a stable id for every binding.

Ids never depend on visit order or global state: ``<op>_<k>`` where ``k`` is the binding's
index among bindings of the same op in topological order; function parameters keep their
names. Layer ids (see :mod:`autoq.ir.registry`) prefer the weight's name.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq.ir.canonicalize import canonicalize
from autoq.ir.prepare import outline_control_flow
from autoq.ir.toolkit import (
    bindings,
    const_array,
    free_vars,
    op_name,
    shape_of,
    short_op_name,
    with_main,
)

__all__ = ["Graph", "GraphError", "WeightRef", "index_function", "prepare"]


class GraphError(ValueError):
    """The input module cannot be quantized as given (and how to fix it)."""


@dataclass(frozen=True, eq=False)
class WeightRef:
    """A value known before any data arrives: its numpy array and, when it derives from one
    named parameter, that parameter's name."""

    array: np.ndarray
    name: str | None


# Data-movement ops evaluated in numpy when all their inputs are weights.
def _np_permute(call, x):
    axes = call.attrs["axes"]
    return np.transpose(x, None if axes is None else [int(a) for a in axes])


def _np_reshape(call, x):
    shape = shape_of(call)
    return None if shape is None else np.reshape(x, shape)


def _np_expand_dims(call, x):
    return np.reshape(x, shape_of(call))


def _np_squeeze(call, x):
    return np.reshape(x, shape_of(call))


def _np_astype(call, x):
    return x.astype(str(call.attrs["dtype"]))


_WEIGHT_FOLD = {
    "relax.permute_dims": _np_permute,
    "relax.reshape": _np_reshape,
    "relax.expand_dims": _np_expand_dims,
    "relax.squeeze": _np_squeeze,
    "relax.astype": _np_astype,
}


@dataclass
class Graph:
    """Bindings of a normalized ``main`` with users, weights and ids (see module doc)."""

    func: relax.Function
    params: dict[str, np.ndarray]
    inputs: list[relax.Var]
    weight_params: list[relax.Var]
    bindings: list[tuple[relax.Var, relax.Expr]]
    output: relax.Expr
    weights: dict[relax.Var, WeightRef] = field(default_factory=dict)
    users: dict[relax.Var, list[relax.Var]] = field(default_factory=dict)
    ids: dict[relax.Var, str] = field(default_factory=dict)
    index: dict[relax.Var, int] = field(default_factory=dict)
    value: dict[relax.Var, relax.Expr] = field(default_factory=dict)
    #: the normalized module: ``main`` and the other functions it calls (e.g. the PrimFuncs
    #: of ``call_tir`` bindings an importer created), which every derived module must keep
    module: tvm.IRModule | None = None

    def weight_of(self, expr) -> WeightRef | None:
        """The weight an operand expression refers to (parameter, binding, or constant)."""
        arr = const_array(expr)
        if arr is not None:
            return WeightRef(arr, None)
        if isinstance(expr, relax.Var):
            return self.weights.get(expr)
        return None

    def is_data_dependent(self, var) -> bool:
        return var not in self.weights

    def output_vars(self) -> list[relax.Var]:
        return free_vars(self.output)

    def var_ids(self) -> Iterable[tuple[relax.Var, str]]:
        return self.ids.items()


def _flatten_bindings(func: relax.Function):
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return [], body
    for block in body.blocks:
        for b in block.bindings:
            if not isinstance(b, relax.VarBinding):
                raise GraphError(
                    "autoq needs a function of plain bindings; found a match_cast binding "
                    f"for {b.var.name}: run relax.transform.Normalize / fix input shapes first"
                )
    return bindings(func), body.body


def prepare(mod: tvm.IRModule, params: dict | None = None, func_name: str = "main") -> Graph:
    """Normalize ``mod[func_name]`` (constants folded, every decomposition in its canonical
    form: :mod:`autoq.ir.canonicalize`) and build its :class:`Graph`.

    ``params`` maps function parameter names to weight arrays (numpy or tvm tensors);
    parameters not in ``params`` are the model's data inputs. ``params`` may be None when
    weights are already bound as constants.
    """
    if not isinstance(mod, tvm.IRModule):
        raise TypeError(f"expected a tvm.IRModule, got {type(mod).__name__}")
    if func_name not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise GraphError(
            f"the module has no function {func_name!r}; it has {[gv.name_hint for gv in mod.get_global_vars()]}"
        )
    params = {
        k: (v.numpy() if hasattr(v, "numpy") else np.asarray(v)) for k, v in (params or {}).items()
    }
    func = mod[func_name]
    if not isinstance(func, relax.Function):
        raise GraphError(f"{func_name!r} is not a Relax function")
    names = [p.name for p in func.params]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise GraphError(
            f"params {unknown} are not parameters of {func_name!r}; its parameters are {names}"
        )
    for p in func.params:
        if p.name in params:
            want, got = shape_of(p), params[p.name].shape
            if want is not None and tuple(want) != tuple(got):
                raise GraphError(f"param {p.name!r} has shape {got}, the function expects {want}")
    seq = tvm.transform.Sequential(
        [
            relax.transform.Normalize(),
            relax.transform.CanonicalizeBindings(),
            relax.transform.FoldConstant(),
        ]
    )
    mod = outline_control_flow(seq(with_main(mod, func, func_name)), func_name)
    mod = canonicalize(mod, func_name, set(params))
    return index_function(mod[func_name], params, mod)


def index_function(
    func: relax.Function, params: dict[str, np.ndarray], module: tvm.IRModule | None = None
) -> Graph:
    """The :class:`Graph` of ``func`` exactly as it is (no normalization: :func:`prepare`
    normalizes first); passes that rewrite the input model in place use it to read bindings,
    users and weights. ``params``: numpy arrays by parameter name."""
    bindings, output = _flatten_bindings(func)
    inputs = [p for p in func.params if p.name not in params]
    weight_params = [p for p in func.params if p.name in params]
    g = Graph(func, params, inputs, weight_params, bindings, output, module=module)
    for p in weight_params:
        g.weights[p] = WeightRef(params[p.name].astype(params[p.name].dtype), p.name)
    counters: dict[str, int] = defaultdict(int)
    for i, (var, value) in enumerate(bindings):
        g.index[var] = i
        g.value[var] = value
        for u in free_vars(value):
            g.users.setdefault(u, []).append(var)
        kind = short_op_name(value)
        g.ids[var] = f"{kind}_{counters[kind]}"
        counters[kind] += 1
        _maybe_fold_weight(g, var, value)
    for p in func.params:
        g.ids[p] = p.name
    return g


def _maybe_fold_weight(g: Graph, var, value) -> None:
    arr = const_array(value)
    if arr is not None:
        g.weights[var] = WeightRef(arr, None)
        return
    if isinstance(value, relax.Var) and value in g.weights:
        g.weights[var] = g.weights[value]
        return
    if not isinstance(value, tvm.ir.Call) or op_name(value) not in _WEIGHT_FOLD:
        return
    refs = [g.weight_of(a) for a in value.args if not isinstance(a, relax.ShapeExpr)]
    if not refs or any(r is None for r in refs):
        return
    arr = _WEIGHT_FOLD[op_name(value)](value, refs[0].array)
    if arr is not None:
        g.weights[var] = WeightRef(np.ascontiguousarray(arr), refs[0].name)
