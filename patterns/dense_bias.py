"""Pattern ``dense_bias``: dense + per-channel bias."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

PATTERN = register(
    make("dense_bias", KINDS["dense"], bias=True, residual=False, doc="dense + per-channel bias")
)
