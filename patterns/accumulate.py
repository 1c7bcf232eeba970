"""The accumulating patterns: conv2d, dense and matmul, each with and without a bias and a
residual add, as one table (a new variant is one row; a new op kind is a module building a
:class:`patterns._accumulate.Kind` and a row of :data:`patterns._kinds.KINDS`)."""

from autoq.ir.registry import register

from ._accumulate import make
from ._kinds import KINDS

#: (pattern name, op kind, bias, residual add, what it matches)
TABLE = (
    ("conv2d", "conv2d", False, False, "nn.conv2d with a constant weight (groups and depthwise included)"),
    ("conv2d_bias", "conv2d", True, False, "conv2d + per-channel bias"),
    ("conv2d_add", "conv2d", False, True, "conv2d + residual activation"),
    ("conv2d_bias_add", "conv2d", True, True, "conv2d + bias + residual activation"),
    ("dense", "dense", False, False, "matmul with a constant 2-D weight (linear / Gemm / dense)"),
    ("dense_bias", "dense", True, False, "dense + per-channel bias"),
    ("dense_bias_add", "dense", True, True, "dense + bias + residual activation (transformer blocks)"),
    ("matmul", "matmul", False, False, "matmul of two activations (attention scores, attention x values)"),
)  # fmt: skip

PATTERNS = [
    register(make(name, KINDS[kind], bias=bias, residual=residual, doc=doc))
    for name, kind, bias, residual, doc in TABLE
]
