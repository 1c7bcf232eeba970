"""Stage 5, realize and finish: the integer module from the one set of matches.

:func:`realize_file` realizes the float module's matches with the file's qparams and
integer weights, reading the tensors the file rounds through ``quantize -> dequantize``
where a float op reads them (``rounding_points``). :func:`finish` then drops the extra
outputs, gives integer inputs back their dtype (``qnn.dequantize`` at the boundary, merged by
:func:`autoq.realization.propagate`) and removes ``astype(int32)`` of an exact unit-scale
dequantize (ConvInteger/MatMulInteger outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq import qnn
from autoq.config import Config
from autoq.importers.file_qparams import SplitResult
from autoq.importers.onnx_graph import np_dtype
from autoq.importers.tensors import main_outputs
from autoq.ir.matching import Matched
from autoq.ir.toolkit import (
    BindingWriter,
    bindings,
    const,
    const_array,
    dtype_of,
    is_call,
    remap_expr,
    with_main,
)
from autoq.qparams import QParam, QParams
from autoq.realization import explicit_multipliers, propagate, realize

__all__ = ["FloatModel", "finish", "realize_file"]


@dataclass(frozen=True, eq=False)
class FloatModel:
    """What the import realized: the matches of the float module and the tensors the file
    rounds where a float op reads them. :func:`autoq.realization` takes it like a
    :class:`autoq.ir.matching.Matched` (nothing is matched again) and applies its
    ``rounding_points``."""

    matched: Matched
    rounding_points: dict[relax.Var, QParam] = field(default_factory=dict)
    #: the file fixes every rounding point: no exit slots of autoq's own (autoq.rules.exits)
    exits: bool = False

    @property
    def mod(self) -> tvm.IRModule:
        """The float module (prepared) whose matches these are."""
        return self.matched.graph.module


def realize_file(model: FloatModel, qparams: QParams, config: Config) -> tvm.IRModule:
    """``realize`` of the file's float model with its qparams (outputs not restored yet)."""
    return realize(
        model.matched, None, qparams, config, rounding_points=model.rounding_points, exits=False
    )


def _is_unit_dequantize(e) -> bool:
    if not is_call(e, "qnn.dequantize"):
        return False
    s, z = const_array(e.args[1]), const_array(e.args[2])
    return (
        dtype_of(e.args[0]) == "int32"
        and s is not None
        and z is not None
        and bool(np.all(s == 1.0))
        and bool(np.all(z == 0))
    )


def _integer_params(func: relax.Function, split: SplitResult, w: BindingWriter, vmap: dict):
    """``func``'s parameters, the file's integer inputs with their integer dtype again (their
    float use is ``qnn.dequantize`` with the file's qparams, emitted into ``w``)."""
    params = []
    for p in func.params:
        if p.name not in split.int_inputs:
            params.append(p)
            continue
        qp, elem = split.int_inputs[p.name]
        nv = relax.Var(p.name, relax.TensorType(p.ty.shape, np_dtype(elem).name))
        params.append(nv)
        s, z = const(qp.scale, "float32"), const(qp.zero_point, "int32")
        vmap[p] = w.emit(qnn.dequantize(nv, s, z))
    return params


def finish(mod: tvm.IRModule, split: SplitResult, rounding: str) -> tvm.IRModule:
    """Drop the extra outputs, give integer inputs back their dtype, remove
    ``astype(int32, qnn.dequantize(int32 x, 1.0, 0))``, and propagate/merge again."""
    func = mod["main"]
    w = BindingWriter()
    vmap: dict = {}
    new_value: dict = {}
    params = _integer_params(func, split, w, vmap)
    pairs = bindings(func)
    for var, value in pairs:
        value = remap_expr(value, vmap)
        if is_call(value, "relax.astype") and str(value.attrs["dtype"]) == "int32":
            src = new_value.get(value.args[0])
            if _is_unit_dequantize(src):
                vmap[var] = src.args[0]
                continue
        nv = w.emit(value, var.name)
        new_value[nv] = value
        vmap[var] = nv
    fields = [remap_expr(f, vmap) for f in main_outputs(func)[1][: split.n_outputs]]
    result = fields[0] if split.n_outputs == 1 else relax.Tuple(fields)
    new = w.finish(params, result)
    new = relax.analysis.remove_all_unused(new.with_attr("global_symbol", "main"))
    mod = propagate(with_main(mod, new), rounding)
    func = explicit_multipliers(relax.analysis.remove_all_unused(mod["main"]))
    out_mod = with_main(mod, func.with_attr("global_symbol", "main"))
    out_mod = relax.transform.EliminateCommonSubexpr()(relax.transform.Normalize()(out_mod))
    return relax.transform.CanonicalizeBindings()(out_mod)
