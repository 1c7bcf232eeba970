"""Pattern ``dense_bias``: dense + per-channel bias."""

from autoq.registry import register

from ._accumulate import make

PATTERN = register(
    make("dense_bias", "dense", bias=True, residual=False, doc="dense + per-channel bias")
)
