"""Elementwise binary kernels for any shape: one PrimFunc per (op, dtypes, ranks, positions
of the size-1 dimensions) instead of one per shape.

TVM legalizes ``add(x, y)`` into a kernel of ``x``'s exact shape, so a graph whose adds and
multiplies run on tensors of 60 shapes compiles 60 adds (PP-OCRv4 det's calibration
module: 119 of its 266 kernels). :data:`BINARY` legalizes these ops with the dimensions other
than 1 symbolic (bound from the arguments when the kernel runs), shared by the operands
where they broadcast against each other, and scalar constants passed as tensors, so that
every add of a rank and a broadcast calls one kernel. Each element is still one IEEE
operation on the same two values: the results are the same bits.

>>> import numpy as np, tvm
>>> from tvm import relax
>>> bb = relax.BlockBuilder()
>>> x = relax.Var("x", relax.TensorType([1, 8, 6, 6], "float32"))
>>> y = relax.Var("y", relax.TensorType([1, 4, 3, 3], "float32"))
>>> with bb.function("main", [x, y]):
...     a = bb.emit(relax.op.add(x, relax.const(np.ones((1, 8, 1, 1), "float32"))))
...     b = bb.emit(relax.op.add(y, relax.const(np.ones((1, 4, 1, 1), "float32"))))
...     _ = bb.emit_func_output(relax.Tuple([a, b]))
>>> lowered = relax.transform.LegalizeOps(legalize_map())(bb.get())
>>> sorted(gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
['add']
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx, topi

__all__ = ["BINARY", "legalize_map"]

#: Relax op -> the TE function of its elementwise kernel (results exact per element)
BINARY = {
    "relax.add": topi.add,
    "relax.subtract": topi.subtract,
    "relax.multiply": topi.multiply,
    "relax.divide": topi.divide,
}


def _static_shape(expr) -> list[int] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return [int(d) for d in ty.shape.values]
    except (TypeError, ValueError, AttributeError):
        return None


def _placeholder(shape: list[int], out_dims: list, dtype: str, name: str) -> te.Tensor:
    """A placeholder of ``shape`` (right-aligned against the output) whose dimensions other
    than 1 are the output's symbolic ones."""
    lead = len(out_dims) - len(shape)
    dims = [tirx.IntImm("int64", 1) if d == 1 else out_dims[lead + k] for k, d in enumerate(shape)]
    return te.placeholder(dims, dtype, name=name)


def _legalize(te_func, name: str):
    default = tvm.ir.Op.get(f"relax.{name}").get_attr("FLegalize")

    def legalize(bb, call):
        shapes = [_static_shape(a) for a in call.args]
        out = _static_shape(call)
        if out is None or None in shapes:
            return default(bb, call)
        out_dims = [
            tirx.IntImm("int64", 1) if d == 1 else tirx.Var(f"n{k}", "int64")
            for k, d in enumerate(out)
        ]
        args = [
            _placeholder(s, out_dims, str(a.ty.dtype), f"x{k}")
            for k, (a, s) in enumerate(zip(call.args, shapes, strict=True))
        ]
        result = te_func(*args)
        gv = bb.add_func(te.create_prim_func([*args, result], "int64"), name)
        return relax.call_tir(gv, list(call.args), out_ty=relax.TensorType(out, result.dtype))

    return legalize


def legalize_map() -> dict:
    """``LegalizeOps``' ``customize_legalize_map`` for the ops of :data:`BINARY` (a call
    whose shapes are not all static is legalized as TVM does)."""
    return {op: _legalize(f, op.split(".")[-1]) for op, f in BINARY.items()}
