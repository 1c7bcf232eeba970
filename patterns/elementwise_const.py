"""Patterns ``add_const``, ``subtract_const``, ``multiply_const``: an activation and a constant
(``x + c``, ``x - c``, ``x * c``), realized as ``qnn.add`` / ``qnn.subtract`` /
``qnn.multiply`` with the constant as an int8 tensor with its own per-tensor qparams (see
``patterns/_elementwise.py``).

On by default (the issue's integer-only activations; the measurement behind the decision is
in docs/ops.md). ``x / c`` reaches them as ``x * (1/c)`` (:mod:`autoq.ir.canonicalize`). An
imported pre-quantized file supplies the constant's integers and qparams (ONNX Runtime
quantizes the constant input of Add/Mul like an activation), also when TVM's ONNX importer
inlined the initializer as a Relax constant.
"""

from autoq.ir.registry import register

from ._elementwise import make

PATTERNS = [
    register(make(kind, doc=f"{kind} of an activation and a constant", constant=True))
    for kind in ("add", "subtract", "multiply")
]
