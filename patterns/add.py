"""Pattern ``add``: sum of two activations (residual connections)."""

from autoq.ir.registry import register

from ._elementwise import make

PATTERN = register(make("add", doc="sum of two activations (residual connections)"))
