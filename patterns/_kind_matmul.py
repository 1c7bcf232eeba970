"""Accumulating kind ``matmul``: ``matmul`` of two float32 activations (attention scores,
attention x values), realized as ``qnn.matmul`` (both operands per-tensor)."""

from __future__ import annotations

from autoq import qnn
from autoq.ir.toolkit import shape_of

from ._accumulate import Kind, is_activation


def _check(g, nodes, core) -> str | None:
    if not is_activation(g, nodes["weight"]):
        return "rhs is not an activation (use dense for weights)"
    if len(shape_of(nodes["data"]) or ()) < 2 or len(shape_of(nodes["weight"]) or ()) < 2:
        return "matmul operands must have rank >= 2"
    return None


def _realize(ctx, m, core, x):
    w = ctx.activation(m["weight"])
    return qnn.matmul(x.q, w.q, x.scale_c, x.zero_point_c, w.scale_c, w.zero_point_c), w


KIND = Kind("matmul", "relax.matmul", None, _check, _realize, channel_axis=lambda rank: rank - 1)
