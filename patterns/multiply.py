"""Pattern ``multiply``: product of two activations (gates, attention-style scaling by an activation)."""

from autoq.registry import register

from ._elementwise import make

PATTERN = register(
    make(
        "multiply",
        doc="product of two activations (gates, attention-style scaling by an activation)",
    )
)
