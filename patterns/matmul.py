"""Pattern ``matmul``: matmul of two activations (attention scores, attention x values)."""

from autoq.registry import register

from ._accumulate import make

PATTERN = register(
    make(
        "matmul",
        "matmul",
        bias=False,
        residual=False,
        doc="matmul of two activations (attention scores, attention x values)",
    )
)
