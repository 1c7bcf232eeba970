"""Pattern ``dense_bias_add``: dense + bias + residual activation (transformer blocks)."""

from autoq.registry import register

from ._accumulate import make

PATTERN = register(
    make(
        "dense_bias_add",
        "dense",
        bias=True,
        residual=True,
        doc="dense + bias + residual activation (transformer blocks)",
    )
)
