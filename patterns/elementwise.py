"""The elementwise patterns of two activations or of an activation and a constant, as one
table (a new one is a row)."""

from autoq.ir.registry import register

from ._elementwise import make

#: (op, what it matches)
TWO_ACTIVATIONS = (
    ("add", "sum of two activations (residual connections)"),
    ("subtract", "difference of two activations"),
    ("multiply", "product of two activations (gates, attention-style scaling by an activation)"),
)
#: ops of an activation and a constant (patterns ``<op>_const``)
WITH_CONSTANT = ("add", "subtract", "multiply")

PATTERNS = [register(make(kind, doc=doc)) for kind, doc in TWO_ACTIVATIONS] + [
    register(make(kind, doc=f"{kind} of an activation and a constant", constant=True))
    for kind in WITH_CONSTANT
]
