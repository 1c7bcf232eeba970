"""The requantize multipliers of TFLite's kernels, for ``rounding="tflite"`` / ``"tflite_single"``.

A ``qnn.requantize`` that ends a layer gets the int32 multiplier and shift that TFLite's
kernel for that layer computes from the layer's own operands (:mod:`autoq.qnn.tflite_arith`),
not the one of its two scales: the accumulator's scale in the canonical graph is the
float32 product ``s_x * s_w`` (or ``s_x / N``), TFLite multiplies in double (or folds
``1 / N`` in by an integer division). One rule per producing op (:data:`RULES`):

* ``qnn.conv2d`` / ``qnn.dense`` / ``qnn.matmul`` (optionally + an int32 bias constant):
  :func:`autoq.qnn.tflite_arith.layer_multiplier` of the op's input and weight scales;
* ``qnn.sum`` (MEAN): :func:`autoq.qnn.tflite_arith.mean_multiplier` with N the reduced count.

A requantize whose input scale is not that layer's (within float32 rounding) keeps the
default multiplier.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import relax

from autoq.ir.toolkit import const_array, is_call, shape_of
from autoq.qnn import tflite_arith as TA

__all__ = ["RULES", "layer_multiplier"]


def _accumulating(core, s_in, s_out):
    s_x, s_w = const_array(core.args[2]), const_array(core.args[4])
    if s_x is None or s_w is None:
        return None
    expected = np.float32(s_x) * np.asarray(s_w, np.float32)
    if expected.shape != np.shape(s_in) or not np.allclose(expected, s_in, rtol=1e-6, atol=0):
        return None
    return TA.layer_multiplier(s_x, s_w, s_out)


def _mean(core, s_in, s_out):
    s_x = const_array(core.args[1])
    shape_in, shape_out = shape_of(core.args[0]), shape_of(core)
    if s_x is None or shape_in is None or shape_out is None or np.ndim(s_in) != 0:
        return None
    count = int(np.prod(shape_in)) // max(int(np.prod(shape_out)), 1)
    if not np.isclose(np.float32(s_x) / np.float32(count), s_in, rtol=1e-6, atol=0):
        return None
    m, shift = TA.mean_multiplier(s_x, s_out, count)
    return np.asarray(m, np.int32), np.asarray(shift, np.int32)


#: producing ``qnn`` op -> ``(op, requantize input scale, output scale) -> (m, shift) | None``
RULES: dict[str, Callable] = {
    "qnn.conv2d": _accumulating,
    "qnn.dense": _accumulating,
    "qnn.matmul": _accumulating,
    "qnn.sum": _mean,
}


def layer_multiplier(call: relax.Call, value_of: Callable) -> tuple | None:
    """``(multiplier, shift)`` int32 arrays for the 5-argument ``qnn.requantize`` ``call`` in
    a ``tflite`` mode, from the op producing its input (``value_of(var)``: the bound value),
    or None (another mode, another producer, runtime scales: the default applies)."""
    if str(call.attrs["rounding"]) not in TA.TFLITE_MODES:
        return None
    s_in, s_out = const_array(call.args[1]), const_array(call.args[3])
    if s_in is None or s_out is None or np.ndim(s_out) != 0:
        return None
    src = value_of(call.args[0])
    if is_call(src, "relax.add") and const_array(src.args[1]) is not None:
        src = value_of(src.args[0])  # the int32 bias
    rule = RULES.get(src.op.name) if is_call(src) else None
    return None if rule is None else rule(src, s_in, s_out)
