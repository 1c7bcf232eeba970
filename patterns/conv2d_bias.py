"""Pattern ``conv2d_bias``: conv2d + per-channel bias."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make("conv2d_bias", KINDS["conv2d"], bias=True, residual=False, doc="conv2d + per-channel bias")
)
