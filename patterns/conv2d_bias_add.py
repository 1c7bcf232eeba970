"""Pattern ``conv2d_bias_add``: conv2d + bias + residual activation."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make(
        "conv2d_bias_add",
        KINDS["conv2d"],
        bias=True,
        residual=True,
        doc="conv2d + bias + residual activation",
    )
)
