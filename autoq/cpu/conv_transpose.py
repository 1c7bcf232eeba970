"""float32 conv2d_transpose whose kernel equals its stride (the 2x2 / stride-2 upsampling of
detection heads) as a sub-pixel product with a fixed schedule.

TVM's generic legalization dilates the input with zeros, pads it and runs a dense conv over
it: for a 2x2 kernel at stride 2, three taps in four multiply a zero, and the loop nest is
naive and serial. When ``kernel == stride`` (no padding, dilation or output padding, one
group) every output pixel ``(s*q + r, s*p + t)`` reads exactly one input pixel::

    out[n, o, s*q + r, s*p + t] = sum_c x[n, c, q, p] * w[c, o, r, t]     (IOHW weights)

The kernel computes that sum (input channels in order, one multiply-add per channel, the
same order the generic legalization adds its non-zero terms in, so results are identical)
into a sub-pixel buffer vectorized along the input row, then interleaves it into NCHW;
parallel over (batch, output channel, input row).
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.s_tir import Schedule

from .injective import KERNEL_ATTR

__all__ = ["conv2d_transpose_kernel"]


def _compute(x_shape, w_shape, dtype: str):
    n, c, h, w = x_shape
    _, o, sh, sw = w_shape
    x = te.placeholder((n, c, h, w), dtype, name="data")
    wt = te.placeholder((c, o, sh, sw), dtype, name="weight")
    rc = te.reduce_axis((0, c), "rc")
    sub = te.compute(
        (n, o, h, sh, sw, w),
        lambda b, oc, q, r, t, p: te.sum(x[b, rc, q, p] * wt[rc, oc, r, t], axis=rc),
        name="autoq_subpixel",
    )
    out = te.compute(
        (n, o, h * sh, w * sw),
        lambda b, oc, y, x_: sub[b, oc, y // sh, y % sh, x_ % sw, x_ // sw],
        name="autoq_interleave",
    )
    return [x, wt, out]


def conv2d_transpose_kernel(x_shape, w_shape, dtype: str = "float32") -> tirx.PrimFunc:
    """The scheduled PrimFunc ``(data[N, C, H, W], weight[C, O, S_h, S_w], out)`` of a
    conv2d_transpose with strides ``(S_h, S_w)`` equal to its kernel size."""
    sch = Schedule(te.create_prim_func(_compute(x_shape, w_shape, dtype)))
    sub = sch.get_sblock("autoq_subpixel")
    b, oc, q, r, t, p, rc = sch.get_loops(sub)
    sch.reorder(b, oc, q, r, t, rc, p)
    sch.reverse_compute_at(sch.get_sblock("autoq_interleave"), q)
    sch.parallel(sch.fuse(b, oc, q))
    init = sch.decompose_reduction(sub, rc)
    sch.vectorize(sch.get_loops(init)[-1])
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
