"""Pattern ``matmul``: matmul of two activations (attention scores, attention x values)."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make(
        "matmul",
        KINDS["matmul"],
        bias=False,
        residual=False,
        doc="matmul of two activations (attention scores, attention x values)",
    )
)
