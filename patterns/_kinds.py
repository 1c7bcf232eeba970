"""The table of accumulating op kinds (one module each): adding a kind is one module that
builds a :class:`patterns._accumulate.Kind` and one row here."""

from __future__ import annotations

from . import _kind_conv2d, _kind_dense, _kind_matmul

KINDS = {k.name: k for k in (_kind_conv2d.KIND, _kind_dense.KIND, _kind_matmul.KIND)}

__all__ = ["KINDS"]
