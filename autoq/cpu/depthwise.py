"""int8 depthwise conv2d (groups = channels, one filter per channel) with fixed schedules.

No dot-product instruction fits (each output sums only KH x KW products). Two kernels,
chosen by :func:`blocked` from the shape and the layouts. Wide 3x3 layers between NCHW tensors: per (batch, channel), the padded
plane ``int16(x - zx)`` is built in cache and every output row accumulates ``KH x KW``
shifted input rows times a scalar weight in int32 (LLVM vectorizes along the row); parallel
over (batch, channel). Blocked input or output (:mod:`autoq.cpu.blocked`), narrow planes and large
filters: the kernel vectorizes across channels: the input is packed once to a channel-blocked,
padded plane of layout NCHW[lanes]c holding the 8-bit codes unsigned (``x + 128`` for int8
data; a blocked input's stored values as they are), padding = the code of the real 0; every
output pixel accumulates ``KH x KW`` code x int16 weight products in an int32 vector of
``lanes`` channels (a register tile of ``tile`` output columns), subtracts ``zero code x
sum(w)`` of its channel (exact: ``sum((u - z) w) = sum(u w) - z sum(w)``), and the tile is
written back. With unsigned 8-bit codes LLVM multiplies by ``vpmaddwd`` / ``vpdpwssd``
instead of the ``vpmulld`` of ``int16(x - zx)`` products (PP-OCRv4 det's layers, VNNI, 1
thread: 3x3 on 240x240 x16 542 -> 429 us, stride 2 on 240x240 x32 485 -> 362, 5x5 on 30x30
x192 186 -> 136; the model 15.56 -> 14.89 ms CPU min).
Parallel over (batch, channel block, output row); weights packed by
:func:`autoq.cpu.packing.pack_depthwise_weight`. Same inputs/outputs otherwise as
``qnn.conv2d`` with ``groups = channels``: NCHW int8/uint8 data, int32 NCHW result.

Per-channel input zero points (``zero_point`` a ``[C]`` array, :mod:`autoq.rules.depthwise_channels`):
both kernels then take them as an int32 input after the weight (the blocked one padded to
whole channel blocks): the row kernel centers channel ``c`` by ``zero_point[c]``, the
blocked one pads channel ``c`` with and subtracts the sum for its code ``zero_point[c] +
shift``. A blocked input then holds ``x + shift`` with the layout's one shift
(:func:`autoq.cpu.blocked.layout_for` with zero point 0: ``x + 128`` on VNNI, ``x`` in
int16 on AVX2); a blocked output does not depend on the input's zero points.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq.cpu.blocked import BlockedLayout, store_blocked
from autoq.cpu.conv2d import ConvShape
from autoq.cpu.epilogue import Epilogue, epilogue_compute
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.packing import pack_depthwise_weight, round_up
from autoq.cpu.tiling import int32, pick_tile

__all__ = [
    "PLANE_PACK_MIN_BLOCKS",
    "blocked",
    "depthwise_kernel",
    "depthwise_weight",
    "zero_point_input",
]

#: the channel-blocked kernel packs each (batch, channel block) plane inside its parallel
#: loop from this many planes on (fewer: one parallel pack pass, rows in parallel)
PLANE_PACK_MIN_BLOCKS = 3


def _compute_blocked(s: ConvShape, data_dtype: str, zero_point: int | np.ndarray, lanes: int, tile: int, epi,
                     layouts=(None, None)):  # fmt: skip
    (kh, kw), (sh, sw), (dh, dw) = s.kernel, s.strides, s.dilation
    pt, pl = s.padding[0], s.padding[1]
    oh, ow = s.out_hw
    owp = round_up(ow, tile)
    hp, wp = (oh - 1) * sh + (kh - 1) * dh + 1, (owp - 1) * sw + (kw - 1) * dw + 1
    cb = round_up(s.in_channels, lanes) // lanes
    in_layout, out_layout = layouts
    if in_layout is None:
        x = te.placeholder((s.batch, s.in_channels, s.height, s.width), data_dtype, name="data")
    else:
        dims = in_layout.shape(s.batch, s.in_channels, s.height, s.width)
        x = te.placeholder(dims, in_layout.dtype, name="data")
    w = te.placeholder((cb, kh, kw, lanes), "int16", name="weight")
    zp, zp_at = _zero_points(zero_point, cb * lanes)
    # the packed plane holds the stored codes (8-bit data: unsigned), padding the code of
    # the real 0; their products with the weights less zero_code * sum(w) are exact
    if in_layout is None:
        shift, code_dtype = (128 if data_dtype == "int8" else 0), "uint8"
    else:
        shift, code_dtype = in_layout.shift, in_layout.dtype

    def zero_code(ch):
        return zp_at(ch) + shift

    def pad(n, c, h, x_, ci):
        ch, hh, ww = c * lanes + ci, h - pt, x_ - pl
        inside = tirx.all(ch < s.in_channels, hh >= 0, hh < s.height, ww >= 0, ww < s.width)
        if in_layout is None:
            value = (int32(x[n, ch, hh, ww]) + shift).astype(code_dtype)
        else:
            value = x[n, c, hh, ww, ci]
        return tirx.if_then_else(inside, value, zero_code(ch).astype(code_dtype))

    padded = te.compute((s.batch, cb, hp, wp, lanes), pad, name="autoq_pack")
    rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")
    acc = te.compute(
        (s.batch, cb, oh, owp, lanes),
        lambda n, c, y, x_, ci: te.sum(
            int32(padded[n, c, y * sh + rh * dh, x_ * sw + rw * dw, ci]) * int32(w[c, rh, rw, ci]),
            axis=[rh, rw],
        ),
        name="autoq_acc",
    )

    def w_sum(c, ci):  # (the same for every pixel of a row: hoisted out of its loop)
        return sum(int32(w[c, i, j, ci]) for i in range(kh) for j in range(kw))

    inputs = [x, w, *zp]
    dims = (s.batch, s.in_channels, oh, ow)

    def value(n, c, y, x_):
        return acc[n, c // lanes, y, x_, c % lanes] - zero_code(c) * w_sum(c // lanes, c % lanes)

    if out_layout is not None:
        out = store_blocked(dims, s.in_channels, value, out_layout, inputs, epi)
    else:
        out = epilogue_compute(dims, value, 1, epi, inputs)
    return [*inputs, out]


def _zero_points(zero_point, length: int):
    """(extra placeholders, ``f(channel) -> int32 zero point``): none and the constant for
    a per-tensor ``zero_point``; a ``[length]`` int32 input for a per-channel one."""
    if np.ndim(zero_point) == 0:
        return [], lambda _ch: tirx.const(int(zero_point), "int32")
    zp = te.placeholder((length,), "int32", name="zero_points")
    return [zp], lambda ch: zp[ch]


def zero_point_input(zero_point, shape: ConvShape, lanes: int, in_layout=None,
                     out_layout=None) -> np.ndarray | None:  # fmt: skip
    """The ``[C]`` (row kernel) or channel-block-padded (blocked kernel) int32 zero points
    :func:`depthwise_kernel` takes for a per-channel ``zero_point`` with the same
    ``in_layout`` / ``out_layout``; None per tensor.

    >>> wide, lay = ConvShape(1, 3, 64, 64, 3, (3, 3)), BlockedLayout(4, "uint8", 128)
    >>> zero_point_input([1, 2, 3], wide, 4), zero_point_input([1, 2, 3], wide, 4, lay)
    (array([1, 2, 3], dtype=int32), array([1, 2, 3, 0], dtype=int32))
    """
    if np.ndim(zero_point) == 0:
        return None
    z = np.asarray(zero_point, np.int32).reshape(-1)
    n = round_up(z.size, lanes) if blocked(shape, in_layout, out_layout) else z.size
    return np.concatenate([z, np.zeros(n - z.size, np.int32)])


def _blocked_kernel(
    shape: ConvShape,
    data_dtype: str,
    zero_point: int | np.ndarray,
    lanes: int,
    epi,
    layouts=(None, None),
):
    tile = pick_tile(shape.out_hw[1], 8)
    tensors = _compute_blocked(shape, data_dtype, zero_point, lanes, tile, epi, layouts)
    sch = Schedule(te.create_prim_func(tensors))
    acc = sch.get_sblock("autoq_acc")
    n, c, y, x_, ci, rh, rw = sch.get_loops(acc)
    xo, xi = sch.split(x_, [None, tile])
    sch.reorder(n, c, y, xo, rh, rw, xi, ci)
    out = sch.get_sblock("autoq_out")
    sch.reverse_compute_at(out, xo if epi is None else y)
    if layouts[1] is not None:  # a vector of channels per pixel
        sch.vectorize(sch.get_loops(out)[-1])
    pack = sch.get_sblock("autoq_pack")
    if shape.batch * round_up(shape.in_channels, lanes) // lanes >= PLANE_PACK_MIN_BLOCKS:
        # each (batch, channel block) packs its padded plane right before its rows read it
        # (in cache instead of a whole-tensor pass)
        nc = sch.fuse(n, c)
        sch.parallel(nc)
        sch.compute_at(pack, nc)
        sch.vectorize(sch.get_loops(pack)[-1])
    else:  # too few planes to share among threads: the pack and the rows in parallel
        sch.parallel(sch.fuse(n, c, y))
        pn, pc, ph, _, pi = sch.get_loops(pack)
        sch.parallel(sch.fuse(pn, pc, ph))
        sch.vectorize(pi)
    sch.unroll(xi)
    sch.vectorize(ci)
    init = sch.decompose_reduction(acc, rh)
    sch.vectorize(sch.get_loops(init)[-1])
    return sch.mod["main"]


def _compute_rows(s: ConvShape, data_dtype: str, zero_point: int | np.ndarray, epi):
    (kh, kw), (sh, sw), (dh, dw) = s.kernel, s.strides, s.dilation
    pt, pl = s.padding[0], s.padding[1]
    oh, ow = s.out_hw
    hp, wp = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1
    x = te.placeholder((s.batch, s.in_channels, s.height, s.width), data_dtype, name="data")
    w = te.placeholder((s.in_channels, 1, kh, kw), "int8", name="weight")
    zp, zp_at = _zero_points(zero_point, s.in_channels)

    def pad(n, c, h, x_):
        hh, ww = h - pt, x_ - pl
        inside = tirx.all(hh >= 0, hh < s.height, ww >= 0, ww < s.width)
        value = (int32(x[n, c, hh, ww]) - zp_at(c)).astype("int16")
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
    if epi is None:
        return [x, w, *zp, out]
    inputs = [x, w, *zp]
    tail = epilogue_compute(out.shape, lambda *i: out[i], 1, epi, inputs)
    return [*inputs, tail]


def _row_kernel(shape: ConvShape, data_dtype: str, zero_point: int | np.ndarray, epi):
    sch = Schedule(te.create_prim_func(_compute_rows(shape, data_dtype, zero_point, epi)))
    block = sch.get_sblock("depthwise")
    n, c, y, x_, rh, rw = sch.get_loops(block)
    sch.reorder(n, c, y, rh, rw, x_)
    if epi is not None:  # requantize each int32 row while it is in cache
        sch.reverse_compute_at(sch.get_sblock("autoq_out"), y)
    nc = sch.fuse(n, c)
    sch.compute_at(sch.get_sblock("pad"), nc)
    sch.parallel(nc)
    sch.decompose_reduction(block, rh)
    return sch.mod["main"]


def blocked(shape: ConvShape, in_layout: BlockedLayout | None = None,
            out_layout: BlockedLayout | None = None) -> bool:  # fmt: skip
    """Whether the channel-blocked kernel serves ``shape``: always when it reads or writes a
    blocked layout (the 1x1 convs around it then need no NCHW pass: MobileNetV2 160x160
    2.37 -> 1.96 ms, EfficientNet-Lite0 4.34 -> 3.54 ms, 1 thread, VNNI); between NCHW
    tensors, narrow outputs or large filters, where a row-vectorized plane has too few
    columns per tap (measured on PP-OCRv4 det's layers: 5x5 on 30x30 x192 6.3 -> 0.75 ms);
    wide 3x3 layers there keep the row kernel, which skips the blocked kernel's pack and
    unpack passes (PP-OCRv4 det's 3x3 on 240x240 x16: 0.26 vs 0.55 ms).

    >>> wide = ConvShape(1, 16, 64, 64, 16, (3, 3), (1, 1), (1, 1, 1, 1))
    >>> blocked(wide), blocked(wide, in_layout=BlockedLayout(16, "uint8", 128))
    (False, True)
    """
    kh, kw = shape.kernel
    if in_layout is not None or out_layout is not None:
        return True
    return shape.out_hw[1] <= 32 or kh * kw > 9


def depthwise_weight(shape: ConvShape, w: np.ndarray, lanes: int, in_layout=None,
                     out_layout=None) -> np.ndarray:  # fmt: skip
    """``[C, 1, KH, KW]`` int8 weights in the form :func:`depthwise_kernel` takes with the
    same ``in_layout`` / ``out_layout``."""
    return pack_depthwise_weight(w, lanes) if blocked(shape, in_layout, out_layout) else w


def depthwise_kernel(
    shape: ConvShape,
    data_dtype: str,
    zero_point: int | np.ndarray,
    lanes: int = 16,
    epilogue: Epilogue | None = None,
    in_layout: BlockedLayout | None = None,
    out_layout: BlockedLayout | None = None,
) -> tirx.PrimFunc:
    """The scheduled PrimFunc ``(data, depthwise_weight(shape, w, lanes)[, zero points][,
    table], out)`` (zero points: :func:`zero_point_input` with the same layouts, per-channel
    ``zero_point`` only) for
    ``shape`` with ``out_channels == in_channels`` (channel multiplier 1); with an
    ``epilogue``, ``out`` is its requantized int8/uint8 output (the table its input).
    ``in_layout`` / ``out_layout`` (blocks of ``lanes``, the channel-blocked kernel; the
    output one needs an epilogue): ``data`` / ``out`` in that layout of
    :mod:`autoq.cpu.blocked`."""
    layouts = (in_layout, out_layout)
    if any(lay is not None and lay.block != lanes for lay in layouts):
        raise ValueError(f"depthwise_kernel: blocked layouts must have blocks of {lanes}")
    if out_layout is not None and epilogue is None:
        raise ValueError("depthwise_kernel: out_layout needs an epilogue")
    if blocked(shape, in_layout, out_layout):
        func = _blocked_kernel(shape, data_dtype, zero_point, lanes, epilogue, layouts)
    else:
        func = _row_kernel(shape, data_dtype, zero_point, epilogue)
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
