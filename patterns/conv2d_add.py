"""Pattern ``conv2d_add``: conv2d + residual activation."""

from autoq.registry import register

from ._accumulate import make

PATTERN = register(
    make("conv2d_add", "conv2d", bias=False, residual=True, doc="conv2d + residual activation")
)
