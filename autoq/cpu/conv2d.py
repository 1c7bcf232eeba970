"""int8 conv2d (groups = 1) as a packed, tensorized PrimFunc with a fixed schedule.

The PrimFunc takes the NCHW int8/uint8 activations (or, with ``in_layout``, the same in the
blocked layout of :mod:`autoq.cpu.blocked`, already shifted: then the kernel only pads them,
or reads them as they are when the conv has no top/left padding), the weights packed by
:func:`autoq.cpu.packing.pack_conv_weight` and (when the activations are shifted) the int32
compensation, and returns the int32 NCHW accumulator of ``conv(x - zx, w)``, exactly what
``qnn.conv2d`` returns. Inside it: pad + shift + pack the activations to NCHW[c]c, accumulate
a register tile of output columns x lane blocks of output channels (per shape:
:func:`register_tile`, rows of :data:`CONV_BLOCKINGS`) with the ISA's dot-product intrinsic, unpack to NCHW (or, with ``out_layout`` and an epilogue, store the
requantized values in that blocked layout for the next conv; with a ``residual``, add the
shortcut's term before the epilogue, :mod:`autoq.cpu.residual`); parallel over (batch,
channel block, output row).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq.cpu.blocked import BlockedLayout, store_blocked
from autoq.cpu.epilogue import Epilogue, epilogue_compute
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.isa import Isa
from autoq.cpu.packing import round_up
from autoq.cpu.residual import Residual, add_shortcut
from autoq.cpu.tiling import i64, int32, pick_tile, tensorize_accumulation

__all__ = ["CONV_BLOCKINGS", "ConvBlocking", "ConvShape", "conv2d_kernel", "register_tile"]


@dataclass(frozen=True)
class ConvShape:
    """Static shape and attributes of one conv2d (NCHW data, OIHW weights)."""

    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, left, bottom, right
    dilation: tuple[int, int] = (1, 1)

    @property
    def out_hw(self) -> tuple[int, int]:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilation
        pt, pl, pb, pr = self.padding
        oh = (self.height + pt + pb - dh * (kh - 1) - 1) // sh + 1
        ow = (self.width + pl + pr - dw * (kw - 1) - 1) // sw + 1
        return oh, ow

    def ic_block(self, isa: Isa, blocked: bool = False) -> int:
        """Input channels per packed activation block (NCHW[ic_block]c); ``blocked``: the
        activations arrive in :func:`autoq.cpu.blocked.layout_for` (blocks of ``isa.lanes``)."""
        if blocked:
            return isa.lanes
        icp = round_up(self.in_channels, isa.k)
        return next(b for b in (64, 32, 16, 8, 4, 2) if b % isa.k == 0 and icp % b == 0)


@dataclass(frozen=True)
class ConvBlocking:
    """A register-blocking row: a conv on the instruction set named ``isa`` with this
    ``kernel`` whose output channels fill whole groups of ``out_blocks`` lane blocks and
    whose output rows have at least ``min_width`` columns and whose weights for one group
    (``out_blocks`` lane blocks x all input channels and taps) take at most
    ``max_group_bytes`` accumulates a register tile of ``pick_tile(width, max_tile)``
    columns x ``out_blocks`` lane blocks (instead of the ISA's ``max_tile`` x
    ``out_blocks``); ``blocked_out``: only convs that store the blocked layout of
    :mod:`autoq.cpu.blocked`. The tile plus one weight register per lane block
    and one broadcast register must fit the 32 zmm / 16 ymm registers."""

    isa: str
    kernel: tuple[int, int]
    min_width: int
    max_tile: int
    out_blocks: int
    max_group_bytes: int
    blocked_out: bool = False

    def __post_init__(self):
        if self.max_tile < 4 or self.out_blocks < 1 or self.max_group_bytes < 1:
            raise ValueError(
                f"ConvBlocking({self.isa}, {self.kernel}): max_tile must be >= 4, "
                f"out_blocks and max_group_bytes >= 1, got {self.max_tile}, "
                f"{self.out_blocks}, {self.max_group_bytes}"
            )
        registers = 32 if self.isa == "vnni" else 16
        if (self.max_tile + 1) * self.out_blocks + 1 > registers:
            raise ValueError(
                f"ConvBlocking({self.isa}, {self.kernel}): {self.max_tile} x "
                f"{self.out_blocks} accumulators + weights + broadcast exceed {registers} "
                "registers; lower max_tile or out_blocks"
            )

    def applies(self, shape: ConvShape, isa: Isa, blocked_out: bool = False) -> bool:
        """Whether this row covers ``shape`` on ``isa`` (storing the blocked layout when
        ``blocked_out``)."""
        (kh, kw), lanes = shape.kernel, isa.lanes * self.out_blocks
        group = round_up(shape.in_channels, isa.k) * kh * kw * lanes
        group *= 2 if isa.weight_dtype == "int16" else 1
        return (
            group <= self.max_group_bytes
            and isa.name == self.isa
            and shape.kernel == self.kernel
            and shape.out_channels % (isa.lanes * self.out_blocks) == 0
            and shape.out_hw[1] >= self.min_width
            and (blocked_out or not self.blocked_out)
        )


# 1x1 convs (ResNet-50's bottlenecks, 14..56 columns, <= 256 input channels): 4..6 columns x
# 4 lane blocks (16-24 zmm accumulators, 4 weight loads per 16-24 vpdpbusd) measured
# 0.85-0.95x the time of 7-8 x 2 per kernel on Zen 5; slower: 7-column rows (padded to 8),
# 512 input channels (a group's 32 KiB of weights per tile of columns), 3x3 convs.
# AVX2 3x3 convs that store the blocked layout: 7 columns x 1 lane block (7 ymm
# accumulators, one weight load per 7 vpmaddwd) measured 0.84-0.96x the time of the default
# 6 x 2 per kernel (SPR, 1 thread, CPU time; 7..120 columns, 16..512 input channels, stride
# 1 and 2; the 7- and 14-column rows no longer pad to 8 / 15); slower with an NCHW output
# (PP-OCRv4 det's 96 -> 24 head convs, 120 / 60 columns: 1.1x) and not faster on AVX2 1x1
# convs or the 7x7 stem (0.95-1.1x)
CONV_BLOCKINGS = (
    ConvBlocking("vnni", (1, 1), min_width=14, max_tile=6, out_blocks=4, max_group_bytes=16384),
    ConvBlocking(
        "avx2",
        (3, 3),
        min_width=7,
        max_tile=7,
        out_blocks=1,
        max_group_bytes=73728,
        blocked_out=True,
    ),
)


def register_tile(shape: ConvShape, isa: Isa, blocked_out: bool = False) -> tuple[int, int]:
    """(output columns, lane blocks of output channels) of the register tile of ``shape``
    (storing the blocked layout when ``blocked_out``): the first row of
    :data:`CONV_BLOCKINGS` that applies, else the ISA's default. The
    output channels stay padded to :meth:`Isa.padded_channels` either way (a row applies
    only when they fill its groups).

    >>> from autoq.cpu.isa import AVX2, VNNI
    >>> register_tile(ConvShape(1, 64, 56, 56, 128, (1, 1)), VNNI)
    (4, 4)
    >>> register_tile(ConvShape(1, 64, 7, 7, 128, (1, 1)), VNNI)
    (7, 2)
    >>> register_tile(ConvShape(1, 512, 14, 14, 128, (1, 1)), VNNI)  # 32 KiB a group
    (7, 2)
    >>> register_tile(ConvShape(1, 64, 56, 56, 128, (3, 3), padding=(1, 1, 1, 1)), VNNI)
    (8, 2)
    >>> register_tile(ConvShape(1, 64, 56, 56, 128, (1, 1)), AVX2)
    (4, 2)
    >>> s = ConvShape(1, 128, 14, 14, 128, (3, 3), padding=(1, 1, 1, 1))
    >>> register_tile(s, AVX2, blocked_out=True), register_tile(s, AVX2)
    ((7, 1), (5, 2))
    """
    ow = shape.out_hw[1]
    for row in CONV_BLOCKINGS:
        if row.applies(shape, isa, blocked_out):
            return pick_tile(ow, row.max_tile), row.out_blocks
    return pick_tile(ow, isa.max_tile), isa.channel_blocks(shape.out_channels)


def _pack(s: ConvShape, isa: Isa, data_dtype: str, shift: int, pad_value: int, icb, hp, wp, lay):
    """(data placeholder, packed activations): a pad + shift + pack stage from NCHW; from
    the blocked ``lay`` a pad stage, or none (the data itself) when no padding is read."""
    pt, pl = s.padding[0], s.padding[1]
    if lay is not None:
        x = te.placeholder(i64(*lay.shape(s.batch, s.in_channels, s.height, s.width)), lay.dtype,
                           name="data")  # fmt: skip
        if pt == pl == 0 and hp <= s.height and wp <= s.width:
            return x, x

        def pad(n, c, h, x_, ci):
            hh, ww = h - pt, x_ - pl
            inside = tirx.all(hh >= 0, hh < s.height, ww >= 0, ww < s.width)
            return tirx.if_then_else(inside, x[n, c, hh, ww, ci], tirx.const(pad_value, lay.dtype))

        shape = (s.batch, lay.shape(1, s.in_channels, 1, 1)[1], hp, wp, icb)
        return x, te.compute(shape, pad, name="autoq_pack")
    x = te.placeholder(i64(s.batch, s.in_channels, s.height, s.width), data_dtype, name="data")

    def pack(n, c, h, x_, ci):
        ic, hh, ww = c * icb + ci, h - pt, x_ - pl
        inside = tirx.all(ic < s.in_channels, hh >= 0, hh < s.height, ww >= 0, ww < s.width)
        value = (int32(x[n, ic, hh, ww]) + shift).astype(isa.act_dtype)
        return tirx.if_then_else(inside, value, tirx.const(pad_value, isa.act_dtype))

    icp = round_up(s.in_channels, icb)
    return x, te.compute((s.batch, icp // icb, hp, wp, icb), pack, name="autoq_pack")


def _compute(shape: ConvShape, isa: Isa, data_dtype: str, shift: int, pad_value: int, comp, epi,
             layouts=(None, None), residual: Residual | None = None):  # fmt: skip
    s, lanes, k = shape, isa.lanes, isa.k
    in_layout, out_layout = layouts
    icb = s.ic_block(isa, in_layout is not None)
    icp, ocp = round_up(s.in_channels, icb), isa.padded_channels(s.out_channels)
    (kh, kw), (sh, sw), (dh, dw) = s.kernel, s.strides, s.dilation
    oh, ow = s.out_hw
    tile = register_tile(s, isa, out_layout is not None)[0]
    owp = round_up(ow, tile)
    hp, wp = (oh - 1) * sh + (kh - 1) * dh + 1, (owp - 1) * sw + (kw - 1) * dw + 1
    x, packed = _pack(s, isa, data_dtype, shift, pad_value, icb, hp, wp, in_layout)
    w = te.placeholder(
        (ocp // lanes, icp // icb, kh, kw, icb // k, lanes, k), isa.weight_dtype, name="weight"
    )
    rc, rh = te.reduce_axis((0, icp // icb), "rc"), te.reduce_axis((0, kh), "rh")
    rw, rb = te.reduce_axis((0, kw), "rw"), te.reduce_axis((0, icb // k), "rb")
    rk = te.reduce_axis((0, k), "rk")
    acc = te.compute(
        (s.batch, ocp // lanes, oh, owp, lanes),
        lambda n, o, y, x_, oi: te.sum(
            int32(packed[n, rc, y * sh + rh * dh, x_ * sw + rw * dw, rb * k + rk])
            * int32(w[o, rc, rh, rw, rb, oi, rk]),
            axis=[rc, rh, rw, rb, rk],
        ),
        name="autoq_acc",
    )
    out_shape = i64(s.batch, s.out_channels, oh, ow)
    c = te.placeholder((ocp,), "int32", name="compensation") if comp else None
    inputs = [x, w] if c is None else [x, w, c]

    def value(n, o, y, x_):
        v = acc[n, o // lanes, y, x_, o % lanes]
        return v if c is None else v - c[o]

    dims = (s.batch, s.out_channels, oh, ow)
    if residual is not None:
        value = add_shortcut(value, residual, dims, inputs)
    if out_layout is not None:
        out = store_blocked(dims, s.out_channels, value, out_layout, inputs, epi)
    else:
        out = epilogue_compute(out_shape, value, 1, epi, inputs)
    return [*inputs, out], tile, packed is not x


def conv2d_kernel(
    shape: ConvShape,
    isa: Isa,
    data_dtype: str,
    zero_point: int,
    epilogue: Epilogue | None = None,
    in_layout: BlockedLayout | None = None,
    out_layout: BlockedLayout | None = None,
    residual: Residual | None = None,
) -> tvm.tirx.PrimFunc:
    """The scheduled PrimFunc ``(data, packed_weight[, compensation], out)``.

    The compensation input exists when the ISA shifts activations by something other than
    ``-zero_point`` (VNNI); pass :func:`autoq.cpu.packing.compensation` of the weights with
    ``zero_point + isa.shift(...)``. With an ``epilogue`` the PrimFunc also takes its table
    (:meth:`autoq.cpu.epilogue.Epilogue.table`) and stores the requantized int8/uint8 output.
    ``in_layout``: ``data`` arrives in that blocked layout (weights packed with
    ``shape.ic_block(isa, blocked=True)``); ``out_layout`` (needs an epilogue): ``out`` is
    stored in it (see :mod:`autoq.cpu.blocked`). ``residual`` (needs an epilogue): the
    PrimFunc also takes the shortcut tensor and its table (after the compensation) and adds
    the shortcut term to the accumulator before the epilogue (:mod:`autoq.cpu.residual`).
    """
    if out_layout is not None and (epilogue is None or out_layout.block != isa.lanes):
        raise ValueError("conv2d_kernel: out_layout needs an epilogue and blocks of isa.lanes")
    if residual is not None and epilogue is None:
        raise ValueError("conv2d_kernel: a residual needs an epilogue")
    if in_layout is not None and in_layout.block != isa.lanes:
        raise ValueError(f"conv2d_kernel: in_layout blocks must be {isa.lanes} on {isa.name}")
    shift = isa.shift(data_dtype, zero_point)
    pad_value = zero_point + shift
    layouts = (in_layout, out_layout)
    tensors, tile, packs = _compute(
        shape, isa, data_dtype, shift, pad_value, pad_value, epilogue, layouts, residual
    )
    sch = Schedule(te.create_prim_func(tensors))
    conv = sch.get_sblock("autoq_acc")
    n, o, y, x_, oi, rc, rh, rw, rb, rk = sch.get_loops(conv)
    xo, xi = sch.split(x_, [None, tile])
    oo, ob = sch.split(o, [None, register_tile(shape, isa, out_layout is not None)[1]])
    sch.reorder(n, oo, y, xo, rc, rh, rw, rb, xi, ob, oi, rk)
    # an epilogue runs per output row (vectorized along it), a plain unpack per tile
    out = sch.get_consumers(conv)[0]
    sch.reverse_compute_at(out, xo if epilogue is None else y)
    sch.parallel(sch.fuse(n, oo, y))
    sch.unroll(xi)
    sch.unroll(ob)
    tensorize_accumulation(sch, conv, rc, oi, isa.intrinsic)
    if out_layout is not None:  # a vector of channels per pixel
        sch.vectorize(sch.get_loops(out)[-1])
    if packs:
        pn, pc, ph, _, pi = sch.get_loops(sch.get_sblock("autoq_pack"))
        sch.parallel(sch.fuse(pn, pc, ph))
        # a vector of channels per pixel: from NCHW the lanes read ic_block planes (a
        # strided gather LLVM builds from the plane loads), 1.4-2x faster than scalar copies
        # (1x1 48 -> 48 on 120 x 120, VNNI, NCHW in, blocked out: 0.93 -> 0.45 ms)
        sch.vectorize(pi)
    # opaque to FuseOps: fusing the epilogue into the autoq_out block (op_pattern 4 +
    # reverse_compute_inline) was measured 5-10% slower on ResNet-50 than separate,
    # row-parallel epilogue functions
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
