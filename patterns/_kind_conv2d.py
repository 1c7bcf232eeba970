"""Accumulating kind ``conv2d``: ``nn.conv2d`` (NCHW/OIHW, any groups) with a constant
float32 weight, realized as ``qnn.conv2d`` (weight quantized per output channel, axis 0)."""

from __future__ import annotations

import numpy as np

from autoq import qnn

from ._accumulate import Kind


def _check(g, nodes, core) -> str | None:
    a = core.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
        return "only NCHW/OIHW conv2d"
    ref = g.weight_of(nodes["weight"])
    if ref is None or ref.array.ndim != 4 or ref.array.dtype != np.float32:
        return "weight is not a constant float32 OIHW tensor"
    return None


def _realize(ctx, m, core, x):
    w = ctx.weight(m["weight"], 0)
    a = core.attrs
    acc = qnn.conv2d(
        x.q, w.q, x.scale_c, x.zero_point_c, w.scale_c, w.zero_point_c,
        strides=[int(v) for v in a.strides], padding=[int(v) for v in a.padding],
        dilation=[int(v) for v in a.dilation], groups=int(a.groups),
    )  # fmt: skip
    return acc, w


KIND = Kind("conv2d", "relax.nn.conv2d", 0, _check, _realize, channel_axis=lambda rank: 1)
