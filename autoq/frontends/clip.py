"""ONNX ``Clip`` back to ``relax.clip``.

TVM's ONNX importer emits ``Clip(x, lo, hi)`` as ``call_tir(maximum, x, lo)`` then
``call_tir(minimum, ., hi)`` behind a NaN guard ``where(isnan(b), -inf/inf, b)`` on each
bound. With constant scalar bounds that is exactly ``relax.clip(x, lo, hi)``, which the
quantizer knows (clip commutes with quantization: ReLU6 and friends). Anything else is left
as it is.
"""

from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax

from autoq.ir.prepare import rebind
from autoq.ir.toolkit import bindings, const_array, is_call, with_main

__all__ = ["raise_clip"]

_MINMAX = re.compile(r"^(maximum|minimum)\d*$")


def raise_clip(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with the importer's lowerings of ``Clip`` in ``main`` turned back into
    ``relax.clip`` (see the module docstring); ``mod`` itself when there is none."""
    func = mod["main"]
    if not isinstance(func.body, relax.SeqExpr):
        return mod
    value_of = dict(bindings(func))
    users: dict[relax.Var, int] = {}
    for expr in [*value_of.values(), func.body.body]:
        for v in relax.analysis.free_vars(expr):
            users[v] = users.get(v, 0) + 1
    values, drop = _clips(value_of, users)
    if not values:
        return mod
    out = with_main(mod, rebind(func, values, drop))
    return relax.transform.DeadCodeElimination(["main"])(out)


def _clips(value_of: dict, users: dict) -> tuple[dict, set]:
    """New values (``relax.clip``) of the outer max/min bindings, and the inner ones to drop."""
    values, drop = {}, set()
    for var, value in value_of.items():
        outer = _min_max(value, value_of)
        if outer is None or var in drop:
            continue
        kind, x, val = outer
        lo, hi = (val, float("inf")) if kind == "maximum" else (float("-inf"), val)
        inner = _min_max(value_of.get(x), value_of) if isinstance(x, relax.Var) else None
        if inner is not None and inner[0] != kind and users.get(x, 0) == 1:
            _, x_in, val_in = inner
            if kind == "minimum":
                lo = val_in
            else:
                hi = val_in
            drop.add(x)
            values.pop(x, None)
            x = x_in
        values[var] = relax.op.clip(x, lo, hi)
    return values, drop


def _min_max(expr, value_of: dict):
    """(kind, x, bound) for call_tir(maximum|minimum, (x, constant scalar bound))."""
    if not is_call(expr, "relax.call_tir"):
        return None
    gv, args = expr.args[0], expr.args[1]
    m = _MINMAX.match(getattr(gv, "name_hint", ""))
    if m is None or not isinstance(args, relax.Tuple) or len(args.fields) != 2:
        return None
    x, b = args.fields
    val = _bound(b, value_of)
    if val is None or _type_key(x) != _type_key(expr):
        return None
    return m.group(1), x, val


def _bound(expr, value_of: dict) -> float | None:
    """A constant scalar bound, directly or behind the NaN guard ``where(isnan(b), repl, b)``."""
    c = _const_scalar(expr)
    if c is not None or not isinstance(expr, relax.Var):
        return c
    where = value_of.get(expr)
    if not is_call(where, "relax.where"):
        return None
    cond, repl, b = where.args
    isnan = value_of.get(cond) if isinstance(cond, relax.Var) else None
    if not (is_call(isnan, "relax.isnan") and isnan.args[0].same_as(b)):
        return None
    b_val, r_val = _const_scalar(b), _const_scalar(repl)
    if b_val is None or r_val is None:
        return None
    return r_val if np.isnan(b_val) else b_val


def _const_scalar(expr) -> float | None:
    arr = const_array(expr)
    if arr is not None and arr.size == 1 and np.issubdtype(arr.dtype, np.floating):
        return float(arr.reshape(()))
    return None


def _type_key(expr):
    """(dtype, dims as text) of a tensor-typed expression (symbolic dims included), or None."""
    ty = expr.ty if isinstance(expr, relax.Expr) else None
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return (str(ty.dtype), tuple(str(d) for d in ty.shape.values))
    return None
