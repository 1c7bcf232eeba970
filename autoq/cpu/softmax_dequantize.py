"""A last-axis softmax of dequantized int8 codes as one kernel reading the codes.

A transformer's realized attention scores reach their softmax as int8 codes (the requantized
``q @ k^T``, its scale multiply and the quantized mask add, all int8) and one per-tensor
``qnn.dequantize``, whose float32 output only the softmax reads. Here
``softmax(qnn.dequantize(q, s, z))`` becomes one call of the softmax kernel that dequantizes
each row as it reads it (``softmax_kernel(..., dequantize=...)``, :mod:`autoq.cpu.softmax`):
the float scores tensor is never written nor read back (a dequantize only its softmax reads
is removed), and the probabilities are the same floats, bit for bit. A per-tensor
``qnn.quantize`` that is the softmax's only reader (attention's ``p @ v`` takes int8
probabilities) goes into the same kernel (``quantize=``): it writes the codes, the float
probabilities are never stored, and the codes are the quantize's, bit for bit.

:func:`fold_dequantize_into_softmax` takes the lowering's half as a callback:
``softmax(bb, codes, shape, dequantize, quantize)`` the kernel call (or None where the kernel
does not cover it).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from autoq.ir.toolkit import bindings, const_array, dtype_of, is_call, read_counts, shape_of

__all__ = [
    "CODE_DTYPES",
    "fold_dequantize_into_softmax",
    "quantized_softmax",
    "softmax_of_codes",
]

CODE_DTYPES = ("int8", "uint8")


def softmax_of_codes(call, value_of: dict) -> tuple | None:
    """``(codes, shape, (dtype, scale, zero point))`` when ``call`` is a last-axis softmax of
    a variable bound (in ``value_of``) to a per-tensor ``qnn.dequantize`` of int8 / uint8
    codes with a static shape of at least two axes (the softmax lowering's), else None."""
    if not is_call(call, "relax.nn.softmax") or not isinstance(call.args[0], relax.Var):
        return None
    deq = value_of.get(call.args[0])
    if deq is None or not is_call(deq, "qnn.dequantize"):
        return None
    q, s, z = deq.args
    shape = shape_of(q)
    qparams = _per_tensor(dtype_of(q), s, z)
    if shape is None or len(shape) < 2 or qparams is None:
        return None
    if int(call.attrs["axis"]) not in (-1, len(shape) - 1):
        return None
    return q, shape, qparams


def _per_tensor(dtype, scale, zero) -> tuple | None:
    """``(dtype, scale, zero point)`` of 8-bit codes with constant per-tensor qparams (the
    expressions ``scale`` and ``zero``), else None."""
    s, z = const_array(scale), const_array(zero)
    if dtype not in CODE_DTYPES or s is None or z is None or s.size != 1 or z.size != 1:
        return None
    return dtype, float(s.reshape(-1)[0]), int(z.reshape(-1)[0])


def quantized_softmax(call, value_of: dict, readers: dict) -> tuple | None:
    """``(softmax_of_codes of the softmax, (dtype, scale, zero point))`` when ``call`` is a
    per-tensor ``qnn.quantize`` (constant qparams, 8-bit codes) of a variable bound (in
    ``value_of``) to a softmax that :func:`softmax_of_codes` accepts and that only ``call``
    reads (``readers``: :func:`autoq.ir.toolkit.read_counts`), else None."""
    if not is_call(call, "qnn.quantize") or not isinstance(call.args[0], relax.Var):
        return None
    soft = value_of.get(call.args[0])
    if soft is None or readers.get(call.args[0], 0) != 1:
        return None
    found = softmax_of_codes(soft, value_of)
    qparams = _per_tensor(str(call.attrs["out_dtype"]), call.args[1], call.args[2])
    if found is None or qparams is None:
        return None
    return found, qparams


@relax.expr_functor.mutator
class _Fold(relax.PyExprMutator):
    def __init__(self, mod, value_of: dict, readers: dict, softmax: Callable):
        super().__init__(mod)
        self.value_of, self.readers, self.softmax = value_of, readers, softmax

    def run(self, gv, func):
        self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.finalize()

    def visit_var_binding_(self, binding):
        quantized = quantized_softmax(binding.value, self.value_of, self.readers)
        found, quantize = quantized or (softmax_of_codes(binding.value, self.value_of), None)
        value = None
        if found is not None:
            q, shape, dequantize = found
            value = self.softmax(self.builder_, self.visit_expr(q), shape, dequantize, quantize)
        if value is None:
            super().visit_var_binding_(binding)
            return
        value = self.builder_.normalize(value)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))


def fold_dequantize_into_softmax(mod: tvm.IRModule, softmax: Callable) -> tvm.IRModule:
    """``mod`` with each softmax of ``main`` that :func:`softmax_of_codes` accepts on
    ``softmax(bb, codes, shape, dequantize, None)``, or, with the quantize that alone reads it
    (:func:`quantized_softmax`), ``softmax(bb, codes, shape, dequantize, quantize)`` (a
    dequantize or softmax nothing else reads then removed)."""
    if not any(gv.name_hint == "main" for gv in mod.get_global_vars()):
        return mod
    func = mod["main"]
    value_of = dict(bindings(func))
    if not any(softmax_of_codes(e, value_of) for e in value_of.values()):
        return mod
    out = _Fold(mod, value_of, read_counts(func), softmax).run(mod.get_global_var("main"), func)
    return relax.transform.DeadCodeElimination()(out)
