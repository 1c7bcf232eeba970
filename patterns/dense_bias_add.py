"""Pattern ``dense_bias_add``: dense + bias + residual activation (transformer blocks)."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make(
        "dense_bias_add",
        KINDS["dense"],
        bias=True,
        residual=True,
        doc="dense + bias + residual activation (transformer blocks)",
    )
)
