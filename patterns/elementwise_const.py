"""Patterns ``add_const``, ``subtract_const``, ``multiply_const``: an activation and a constant
(``x + c``, ``x - c``, ``x * c``), realized as ``qnn.add`` / ``qnn.subtract`` /
``qnn.multiply`` with the constant as an int8 tensor with its own per-tensor qparams (see
``patterns/_elementwise.py``).

**Opt-in** (``Pattern.default=False``): they run only when ``Config.patterns`` names them,
e.g. ``Config(patterns=(*[p.name for p in autoq.registry.ordered_patterns()],
"multiply_const"))`` (``ordered_patterns()`` lists the default ones). By default these
ops stay fp32 as before: turning them on changes the layer list of attention graphs (the
``scores * 1/sqrt(d)`` before softmax becomes an int8 layer) and, for pre-quantized files,
reports a fallback wherever the file leaves such an op in float (an inline constant has no
initializer the file could quantize); making them the default needs those two decided.
"""

from autoq.registry import register

from ._elementwise import make

PATTERNS = [
    register(make(kind, doc=f"{kind} of an activation and a constant", constant=True))
    for kind in ("add", "subtract", "multiply")
]
