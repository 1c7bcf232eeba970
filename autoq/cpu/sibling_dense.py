"""Sibling dynamic dense layers (one input, one run-time zero point) as one packed kernel call.

A transformer's query, key and value projections read the same per-token quantized input
(one ``qnn.dynamic_quantize``: the same codes, scales and zero points). Each is a
``qnn.dense`` with its own constant weight, which the CPU lowering runs as ``x @ w.T`` on
the packed kernel minus ``z_x * sum(w)`` (:func:`minus_zero_point`). Here the siblings'
weights are concatenated along the output channels and the kernel runs once, ``[M, K] x
[N1 + N2 + ..., K]^T``; each layer takes its columns of the int32 accumulator
(``strided_slice``) and subtracts its own correction. Every column is accumulated as
before (the same products in the same order, exact int32): the outputs are unchanged, bit
for bit. all-MiniLM-L6-v2 (1 thread): three 128 x 384 x 384 calls 528 us, one 128 x 384 x
1152 call 400 us.

:func:`merge_sibling_dense` takes the lowering's two halves as callbacks: ``operands(call)``
(``(data, weight [N, K], data dtype, zero point)`` of a dense the kernels cover with a
run-time zero point, or None; called on ``qnn.dense`` calls only) and ``accumulate(bb, data, weight, dtype)`` (the kernel's
int32 ``data @ weight.T``).

>>> import numpy as np
>>> from tvm import relax
>>> acc = relax.Var("acc", relax.TensorType((4, 6), "int32"))
>>> z = relax.Var("z", relax.TensorType((4, 1), "int32"))
>>> minus_zero_point(acc, z, np.ones((6, 3), np.int8)).op.name
'relax.subtract'
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from autoq.ir.toolkit import bindings, is_call, shape_of

__all__ = ["merge_sibling_dense", "minus_zero_point"]


def minus_zero_point(acc, z_x, w: np.ndarray) -> relax.Expr:
    """``acc - z_x * sum_k(w)``: ``(x - z_x) @ w.T`` from the kernel's ``x @ w.T`` (the same
    int32 terms as the ``qnn.dense`` legalization); ``w`` is ``[N, K]``."""
    wsum = relax.const(w.astype(np.int64).sum(axis=1).astype(np.int32))
    return relax.op.subtract(acc, relax.op.multiply(z_x, wsum))


def _groups(func: relax.Function, operands: Callable) -> dict:
    """First member's var -> [(var, operands)] of every group of >= 2 dense bindings with
    the same data and zero point variables, in binding order."""
    by_key: dict = {}
    for var, value in bindings(func):
        ops = operands(value) if is_call(value, "qnn.dense") else None
        if ops is None or not all(isinstance(e, relax.Var) for e in (ops[0], ops[3])):
            continue
        by_key.setdefault((ops[0], ops[3], ops[2]), []).append((var, ops))
    return {members[0][0]: members for members in by_key.values() if len(members) > 1}


@relax.expr_functor.mutator
class _Merge(relax.PyExprMutator):
    def __init__(self, mod, groups: dict, accumulate: Callable):
        super().__init__(mod)
        self.groups, self.accumulate = groups, accumulate
        self.later = {var for members in groups.values() for var, _ in members[1:]}

    def run(self, gv, func):
        self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.finalize()

    def visit_var_binding_(self, binding):
        if binding.var in self.later:
            return  # emitted with the group's first member
        members = self.groups.get(binding.var)
        if members is None:
            super().visit_var_binding_(binding)
            return
        data, _, dt, z_x = members[0][1]
        data, z_x = self.visit_expr(data), self.visit_expr(z_x)
        weights = [ops[1] for _, ops in members]
        acc = self.builder_.emit(self.accumulate(self.builder_, data, np.concatenate(weights), dt))
        axis, start = len(shape_of(acc)) - 1, 0
        for (var, _), w in zip(members, weights, strict=True):
            end = start + w.shape[0]
            cols = relax.op.strided_slice(acc, [axis], [start], [end])
            value = self.builder_.normalize(minus_zero_point(cols, z_x, w))
            self.builder_.emit_normalized(relax.VarBinding(var, value))
            start = end


def merge_sibling_dense(
    mod: tvm.IRModule, operands: Callable, accumulate: Callable
) -> tvm.IRModule:
    """``mod`` with each group of sibling dense layers in ``main`` (the same data and
    run-time zero point variables, see the module docstring) on one kernel call."""
    if not any(gv.name_hint == "main" for gv in mod.get_global_vars()):
        return mod
    gv = mod.get_global_var("main")
    groups = _groups(mod["main"], operands)
    if not groups:
        return mod
    return _Merge(mod, groups, accumulate).run(gv, mod["main"])
