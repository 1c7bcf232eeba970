"""Pattern ``dense``: matmul with a constant 2-D weight (linear / Gemm / dense)."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make(
        "dense",
        KINDS["dense"],
        bias=False,
        residual=False,
        doc="matmul with a constant 2-D weight (linear / Gemm / dense)",
    )
)
