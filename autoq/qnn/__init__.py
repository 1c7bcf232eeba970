"""The ``qnn.*`` op set: quantized operators as real Relax ops, registered from Python.

TVM 0.27 has no QNN dialect; this package defines one. Importing it registers every op
(``RegisterOp`` + ``FInferType`` + ``FPurity``) and its legalization, so the ops type-check,
print, serialize, and compile with ``tvm.compile`` on any target that Relax legalizes for.

One module per idea: :mod:`.checks` (dtype conventions, argument checks, :class:`QnnError`),
:mod:`.registration` (``register``, :data:`OPS`), :mod:`.tensor_exprs` (the TE expressions
the legalizations share, integer requantize math included), :mod:`.quantize`
(quantize/dequantize/requantize), :mod:`.simulated` (the float32 calibration-graph ops),
:mod:`.accumulate` (conv2d/dense/matmul/sum), :mod:`.elementwise` (add/subtract/multiply),
:mod:`.lut` (8-bit activations as table lookups) and :mod:`.dynamic_quantize` (run-time
qparams, see :mod:`autoq.realization.dynamic`).

One convention everywhere (see ``docs/ops.md`` for the table):

* every quantized operand is followed by its ``scale`` (float32) and ``zero_point`` (int32),
  each a scalar (per-tensor) or a 1-D tensor (per-axis); constants in a deployed graph,
  runtime inputs during calibration;
* real value = ``(q - zero_point) * scale``;
* per-axis parameters index the ``axis`` attribute's dimension; for ``qnn.conv2d`` and
  ``qnn.dense`` the weight's parameters index its output-channel dimension;
* ops that accumulate (``conv2d``, ``dense``, ``matmul``, ``sum``) return int32 with scale
  ``input_scale * weight_scale`` (per output channel) and zero point 0; the following
  ``qnn.requantize`` or ``qnn.dequantize`` carries that product as its input scale;
* elementwise ops (``add``, ``subtract``, ``multiply``) take their own output scale and
  zero point and return int8/uint8;
* ``rounding`` (requantize and elementwise ops): ``float`` (default) computes in float32
  exactly like ``quantize(dequantize(x))``; the integer-only modes are listed in
  :data:`autoq.primitives.ROUNDING_MODES`.

The builder functions (``conv2d(...)`` etc.) return ``tvm.ir.Call`` nodes with the
attributes in a ``DictAttrs``; type inference checks dtypes, shapes, per-axis lengths and,
when they are constants, that scales are positive and zero points inside the dtype's range,
and raises ``QnnError`` naming the op, the argument and what was expected.
"""

from __future__ import annotations

from autoq.qnn.accumulate import conv2d, dense, matmul, sum
from autoq.qnn.checks import ACC_DTYPE, ACC_INPUT_DTYPES, QDTYPES, QnnError
from autoq.qnn.dynamic_quantize import dynamic_quantize
from autoq.qnn.elementwise import add, multiply, subtract
from autoq.qnn.lut import lut
from autoq.qnn.quantize import dequantize, quantize, requantize, with_multipliers
from autoq.qnn.registration import OPS
from autoq.qnn.simulated import simulated_dequantize, simulated_quantize

__all__ = [
    "ACC_DTYPE",
    "ACC_INPUT_DTYPES",
    "OPS",
    "QDTYPES",
    "QnnError",
    "add",
    "conv2d",
    "dense",
    "dequantize",
    "dynamic_quantize",
    "lut",
    "matmul",
    "multiply",
    "quantize",
    "requantize",
    "simulated_dequantize",
    "simulated_quantize",
    "subtract",
    "sum",
    "with_multipliers",
]
