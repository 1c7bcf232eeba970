"""Accumulating kind ``dense``: ``matmul(x, W)`` with a constant 2-D float32 weight (linear,
Gemm), realized as ``qnn.dense`` with the weight transposed to ``[N, K]`` (per-channel
scales along N)."""

from __future__ import annotations

import numpy as np

from autoq import qnn
from autoq.ir.toolkit import shape_of

from ._accumulate import Kind


def _check(g, nodes, core) -> str | None:
    ref = g.weight_of(nodes["weight"])
    if ref is None or ref.array.ndim != 2 or ref.array.dtype != np.float32:
        return "rhs is not a constant 2-D float32 weight"
    if len(shape_of(nodes["data"]) or ()) < 1:
        return "data has no static shape"
    return None


def _realize(ctx, m, core, x):
    w = ctx.weight(m["weight"], 1, transpose=(1, 0))
    return qnn.dense(x.q, w.q, x.scale_c, x.zero_point_c, w.scale_c, w.zero_point_c), w


KIND = Kind(
    "dense", "relax.matmul", 1, _check, _realize, channel_axis=lambda rank: rank - 1, dynamic=True
)
