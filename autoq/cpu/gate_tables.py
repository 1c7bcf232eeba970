"""A channel gate ``x + x * g[c]`` as one lookup per channel, its tables built at run time.

A squeeze-and-excitation block with a residual (PP-OCRv4 det's RSE neck) is realized as

    m = qnn.multiply(x, g)        # g: [1, C, 1, 1], the gate, computed from x
    y = qnn.add(x, m)             # y[n, c, h, w] depends on x[n, c, h, w] and g[c] alone

so ``y = table[c, x - qmin]`` with ``table[c, k] = qnn.add(k, qnn.multiply(k, g))[c]`` over
the 256 codes ``k``. :func:`gate_tables` writes the chain as that: the same two ``qnn`` ops on
a ``[1, 1, 1, 256]`` constant of every code (broadcast against the gate: ``C x 256`` values,
the same scalar expressions the fused kernel evaluates per element, so the same floats in
every rounding mode), then ``qnn.lut`` with ``axis=1`` (the VBMI channel lookup). Where a
channel's plane holds more than 256 pixels this evaluates fewer of the float chain's two
divisions: the 96 x 120 x 120 gate of PP-OCRv4 det's largest level 1.38 M elements ->
24576 table entries.

>>> import numpy as np
>>> import numpy as np
>>> from autoq import primitives as P
>>> x = np.array([[-3, 5, 5, -3]], dtype=np.int8)  # channel 0 of a [1, 1, 1, 4] tensor
>>> gate = np.array([72], dtype=np.int8)
>>> def chain(v):
...     m = P.elementwise("multiply", v, 0.1, 0, gate, 1 / 255, -128, 0.1, 0, "int8", "float")
...     return P.elementwise("add", v, 0.1, 0, m, 0.1, 0, 0.2, 0, "int8", "float")
>>> table = chain(np.arange(-128, 128))
>>> bool((table[x.astype(np.int32) + 128] == chain(x)).all())
True
"""

from __future__ import annotations

import tvm
from tvm import relax

from autoq import primitives as P
from autoq import qnn
from autoq.ir import toolkit as tk

__all__ = ["gate_tables"]

CODES = ("int8", "uint8")
# below this many pixels per channel the C x 256 table costs more than the chain itself
MIN_PLANE = 257


def _gate_chain(value, once) -> tuple[relax.Expr, relax.Call, relax.Call, int] | None:
    """``(x, the multiply, the add, x's operand index in the add)`` when ``value`` is
    ``qnn.add(x, qnn.multiply(x, g))`` (either operand order in both) with per-tensor
    qparams, ``x`` 8-bit NCHW with planes of at least ``MIN_PLANE`` pixels and ``g`` of
    shape ``[1, C, 1, 1]``; else None."""
    if not tk.is_call(value, "qnn.add") or value.attrs.get("axis") is not None:
        return None
    for k in (0, 1):
        x, mvar = value.args[k], value.args[1 - k]
        mul = once(mvar)
        if not tk.is_call(mul, "qnn.multiply") or mul.attrs.get("axis") is not None:
            continue
        if not any(a.same_as(x) for a in mul.args[:2]) or not isinstance(x, relax.Var):
            continue
        g = mul.args[1] if mul.args[0].same_as(x) else mul.args[0]
        shape, gshape = tk.shape_of(x), tk.shape_of(g)
        if shape is None or gshape is None or len(shape) != 4 or tk.dtype_of(x) not in CODES:
            continue
        if tuple(gshape) != (1, shape[1], 1, 1) or tk.shape_of(value) != shape:
            continue
        if str(value.attrs["out_dtype"]) not in CODES or shape[2] * shape[3] < MIN_PLANE:
            continue
        if any(tk.const_array(q) is None for q in (*mul.args[2:], *value.args[2:])):
            continue
        return x, mul, value, k
    return None


def _table_lookup(x, mul: relax.Call, add: relax.Call, k: int) -> relax.Expr:
    """``qnn.lut(x, table, axis=1)`` with ``table`` the chain on every code (operands in the
    chain's order), ``[C, 256]``."""
    codes = relax.const(P.all_codes(tk.dtype_of(x)).reshape(1, 1, 1, 256))
    margs = [codes if a.same_as(x) else a for a in mul.args[:2]]
    m = tvm.ir.Call(mul.op, [*margs, *mul.args[2:]], mul.attrs)
    aargs = [codes, m] if k == 0 else [m, codes]
    table = tvm.ir.Call(add.op, [*aargs, *add.args[2:]], add.attrs)
    channels = tk.shape_of(x)[1]
    return qnn.lut(x, relax.op.reshape(table, [channels, 256]), axis=1)


def gate_tables(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every channel gate of :func:`_gate_chain` in ``main`` as a per-channel
    lookup whose tables are computed at run time (the same values)."""

    def rewrite(value, once, _lookup):
        found = _gate_chain(value, once)
        return None if found is None else _table_lookup(*found)

    return tk.rewrite_main(mod, rewrite)
