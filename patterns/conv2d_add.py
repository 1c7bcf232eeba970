"""Pattern ``conv2d_add``: conv2d + residual activation."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make(
        "conv2d_add", KINDS["conv2d"], bias=False, residual=True, doc="conv2d + residual activation"
    )
)
