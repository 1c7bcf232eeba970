"""float32 conv2d_transpose whose kernel equals its stride (the 2x2 / stride-2 upsampling of
detection heads) as a sub-pixel product with a fixed schedule.

TVM's generic legalization dilates the input with zeros, pads it and runs a dense conv over
it: for a 2x2 kernel at stride 2, three taps in four multiply a zero, and the loop nest is
naive and serial. When ``kernel == stride`` (no padding, dilation or output padding, one
group) every output pixel ``(s*q + r, s*p + t)`` reads exactly one input pixel::

    out[n, o, s*q + r, s*p + t] = sum_c x[n, c, q, p] * w[c, o, r, t]     (IOHW weights)

The kernel computes that sum (input channels in order, one multiply-add per channel, the
same order the generic legalization adds its non-zero terms in, so results are identical)
into a sub-pixel buffer, register blocked (output channels x a vector of input pixels), then
interleaves it into NCHW; parallel over (batch, input row, output channel block).
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq.cpu.injective import KERNEL_ATTR

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


def _block(extent: int, sizes: tuple[int, ...]) -> int:
    """The first of ``sizes`` that divides ``extent`` (1 if none)."""
    return next((b for b in sizes if extent % b == 0), 1)


def conv2d_transpose_kernel(
    x_shape, w_shape, dtype: str = "float32", accumulators: int = 12
) -> tirx.PrimFunc:
    """The scheduled PrimFunc ``(data[N, C, H, W], weight[C, O, S_h, S_w], out)`` of a
    conv2d_transpose with strides ``(S_h, S_w)`` equal to its kernel size: per input row,
    a register block of up to 8 output channels x up to 3 vectors of 16/8/4 input pixels
    (at most ``accumulators`` vector registers: 24 of AVX-512's 32, 12 of AVX2's 16)
    accumulates over the input channels (one load of an input vector serves every channel of
    the block, one broadcast weight every vector); parallel over (batch, input row, channel
    block)."""
    sch = Schedule(te.create_prim_func(_compute(x_shape, w_shape, dtype)))
    sub = sch.get_sblock("autoq_subpixel")
    b, oc, q, r, t, p, rc = sch.get_loops(sub)
    oc_block = _block(int(w_shape[1]), (8, 6, 4, 3, 2))
    oc_o, oc_i = sch.split(oc, [None, oc_block])
    lanes = _block(int(x_shape[3]), (16, 8, 4))
    fits = tuple(v for v in (3, 2) if v * oc_block <= accumulators)
    vectors = _block(int(x_shape[3]) // lanes, fits)
    p_o, p_m, p_i = sch.split(p, [None, vectors, lanes])
    sch.reorder(b, q, oc_o, p_o, r, t, rc, oc_i, p_m, p_i)
    sch.unroll(p_m)
    task = sch.fuse(b, q, oc_o)
    inter = sch.get_sblock("autoq_interleave")
    sch.reverse_compute_at(inter, task)
    # x = S_w * p + t with the S_w sub-pixels unrolled: contiguous reads along p, which LLVM
    # vectorizes into interleaved stores (instead of a gather through x % S_w, x // S_w)
    sch.unroll(sch.split(sch.get_loops(inter)[-1], [None, int(w_shape[3])])[1])
    sch.parallel(task)
    sch.unroll(oc_i)
    sch.vectorize(p_i)
    init = sch.decompose_reduction(sub, rc)
    sch.vectorize(sch.get_loops(init)[-1])
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
