"""Pattern ``conv2d``: nn.conv2d with a constant weight (groups and depthwise included)."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make(
        "conv2d",
        KINDS["conv2d"],
        bias=False,
        residual=False,
        doc="nn.conv2d with a constant weight (groups and depthwise included)",
    )
)
