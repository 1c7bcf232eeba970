"""Pattern ``subtract``: difference of two activations."""

from autoq.ir.registry import register

from ._elementwise import make

PATTERN = register(make("subtract", doc="difference of two activations"))
