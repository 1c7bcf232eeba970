"""int8 depthwise conv2d (groups = channels, one filter per channel) with a fixed schedule.

No dot-product instruction fits (each output sums only KH x KW products), so the kernel
widens once and lets LLVM vectorize along the output row: per (batch, channel), the padded
plane ``int16(x - zx)`` (exact, padding = real 0) is built in cache, then every output row
accumulates ``KH x KW`` shifted input rows times a scalar weight in int32. Parallel over
(batch, channel). Same inputs/outputs as ``qnn.conv2d`` with ``groups = channels``: NCHW
int8/uint8 data, ``[C, 1, KH, KW]`` int8 weights, int32 NCHW result.
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.s_tir import Schedule

from .conv2d import ConvShape
from .injective import KERNEL_ATTR
from .tiling import int32

__all__ = ["depthwise_kernel"]


def _compute(s: ConvShape, data_dtype: str, zero_point: int):
    (kh, kw), (sh, sw), (dh, dw) = s.kernel, s.strides, s.dilation
    pt, pl = s.padding[0], s.padding[1]
    oh, ow = s.out_hw
    hp, wp = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    x = te.placeholder((s.batch, s.in_channels, s.height, s.width), data_dtype, name="data")
    w = te.placeholder((s.in_channels, 1, kh, kw), "int8", name="weight")

    def pad(n, c, h, x_):
        hh, ww = h - pt, x_ - pl
        inside = tirx.all(hh >= 0, hh < s.height, ww >= 0, ww < s.width)
        value = (int32(x[n, c, hh, ww]) - zero_point).astype("int16")
        return tirx.if_then_else(inside, value, tirx.const(0, "int16"))

    padded = te.compute((s.batch, s.in_channels, hp, wp), pad, name="pad")
    rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")
    out = te.compute(
        (s.batch, s.in_channels, oh, ow),
        lambda n, c, y, x_: te.sum(
            int32(padded[n, c, y * sh + rh * dh, x_ * sw + rw * dw]) * int32(w[c, 0, rh, rw]),
            axis=[rh, rw],
        ),
        name="depthwise",
    )
    return [x, w, out]


def depthwise_kernel(shape: ConvShape, data_dtype: str, zero_point: int) -> tirx.PrimFunc:
    """The scheduled PrimFunc ``(data, weight[C, 1, KH, KW], out)`` for ``shape`` with
    ``out_channels == in_channels`` (channel multiplier 1)."""
    sch = Schedule(te.create_prim_func(_compute(shape, data_dtype, zero_point)))
    block = sch.get_sblock("depthwise")
    n, c, y, x_, rh, rw = sch.get_loops(block)
    sch.reorder(n, c, y, rh, rw, x_)
    nc = sch.fuse(n, c)
    sch.compute_at(sch.get_sblock("pad"), nc)
    sch.parallel(nc)
    sch.decompose_reduction(block, rh)
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
