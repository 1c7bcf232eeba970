"""Elementwise kernels for any shape: one PrimFunc per (op, dtypes, ranks, positions of the
size-1 dimensions of a binary op's operands, immediates of a unary op) instead of one per shape.

TVM legalizes ``add(x, y)`` into a kernel of ``x``'s exact shape, so a graph whose adds and
multiplies run on tensors of 60 shapes compiles 60 adds (PP-OCRv4 det's calibration
module: 119 of its 266 kernels). :data:`BINARY` legalizes these ops with the dimensions other
than 1 symbolic (bound from the arguments when the kernel runs), shared by the operands
where they broadcast against each other, and scalar constants passed as tensors, so that
every add of a rank and a broadcast calls one kernel. :data:`UNARY` does the same for the
one-operand ops (cast, relu, clip, sigmoid, hard-sigmoid / hard-swish) with every dimension
symbolic; their immediates (clip's bounds, the cast's dtype) stay in the kernel. Each
element is still the same IEEE operations on the same values: the results are the same bits.

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
>>> with bb.function("relus", [x, y]):
...     _ = bb.emit_func_output(relax.Tuple([relax.op.nn.relu(x), relax.op.nn.relu(y)]))
>>> lowered = relax.transform.LegalizeOps(legalize_map())(bb.get())
>>> sorted(gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
['add', 'relu']
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx, topi

from autoq.ir.canonicalize import hard_te

__all__ = ["BINARY", "UNARY", "legalize_map"]

#: Relax op -> the TE function of its elementwise kernel (results exact per element)
BINARY = {
    "relax.add": topi.add,
    "relax.subtract": topi.subtract,
    "relax.multiply": topi.multiply,
    "relax.divide": topi.divide,
}

#: Relax op -> its kernel's TE function of (the call, the operand), as TVM / autoq legalize it
UNARY = {
    "relax.astype": lambda call, x: topi.cast(x, call.attrs.dtype),
    "relax.nn.relu": lambda call, x: topi.nn.relu(x),
    "relax.sigmoid": lambda call, x: topi.sigmoid(x),
    "relax.clip": lambda call, x: topi.clip(x, call.args[1], call.args[2]),
    "autoq.hardswish": lambda call, x: hard_te(x, True),
    "autoq.hardsigmoid": lambda call, x: hard_te(x, False),
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
        return _call_kernel(bb, name, args, te_func(*args), list(call.args), out)

    return legalize


def _call_kernel(bb, name: str, holders: list, result, args: list, out_shape: list[int]):
    """The call of the shape-generic kernel ``holders -> result`` on ``args`` (static
    output shape ``out_shape``)."""
    gv = bb.add_func(te.create_prim_func([*holders, result], "int64"), name)
    return relax.call_tir(gv, args, out_ty=relax.TensorType(out_shape, result.dtype))


def _immediates(call) -> bool:
    return all(isinstance(a, tirx.IntImm | tirx.FloatImm) for a in call.args[1:])


def _legalize_unary(te_func, name: str):
    default = tvm.ir.Op.get(name).get_attr("FLegalize")

    def legalize(bb, call):
        x = call.args[0]
        shape = _static_shape(x)
        if shape is None or isinstance(x, tvm.ir.GenericConst) or not _immediates(call):
            return default(bb, call)  # (a constant operand: TVM folds it)
        dims = [tirx.Var(f"n{k}", "int64") for k in range(len(shape))]
        arg = te.placeholder(dims, str(x.ty.dtype), name="x")
        return _call_kernel(bb, name.split(".")[-1], [arg], te_func(call, arg), [x], shape)

    return legalize


def legalize_map() -> dict:
    """``LegalizeOps``' ``customize_legalize_map`` for the ops of :data:`BINARY` and
    :data:`UNARY` (a call whose shapes are not all static is legalized as before)."""
    binary = {op: _legalize(f, op.split(".")[-1]) for op, f in BINARY.items()}
    return binary | {op: _legalize_unary(f, op) for op, f in UNARY.items()}
