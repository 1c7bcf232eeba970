"""Pattern ``multiply``: product of two activations (gates, attention-style scaling by an activation)."""

from autoq.ir.registry import register

from ._elementwise import make

PATTERN = register(
    make(
        "multiply",
        doc="product of two activations (gates, attention-style scaling by an activation)",
    )
)
