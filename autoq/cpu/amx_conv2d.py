"""int8 conv2d (groups 1, stride 1, dilation 1) on Intel AMX tiles, as an implicit GEMM
computed channels x pixels, so that the tiles store straight into the NCHW output.

Activations are packed once, per image, to the VNNI-interleaved uint8 buffer
``[ICp/4, P, 4]`` over the padded image (``ICp`` input channels rounded up to 64, ``P`` the
flat pixels of ``rows x Wp``, ``Wp`` the padded width; ``x + 128`` for int8 data, padding =
the shifted zero point). Output pixels are numbered over the padded width,
``p = oy * Wp + ox``: with stride 1 the input pixel of tap ``(kh, kw)`` is the flat pixel
``p + kh * Wp + kw``, so a tile of 16 consecutive output pixels x 64 input channels of one tap
is 16 rows (channel quads) of 64 contiguous bytes, row stride ``4 P``: a ``tdpbsud`` column
operand (int8 weights x uint8 activations). The columns ``ox >= OW`` are computed and
dropped (``(KW - 1) / Wp`` extra work, none for 1x1). Fewer than 64 input channels fold
neighbouring horizontal taps into one 64-byte row (:func:`tap_fold`): packed copy ``s`` of
the channels is their packed rows ``s`` pixels left (a vector copy of the rows), so that
ResNet-50-1by2's 3x3 32 -> 32 convs run on AMX with 6 tile steps instead of 9 (56 x 56,
int8 out, 1 thread: 100 us unfolded on AMX -> 83 us).

Weights are the row operand, ``[OCp/16, KH*KW*ICp/64, 16, 64]`` (:func:`amx_conv_weight`).
A block of 32 output channels x 32 pixels is the 2 x 2 accumulator tiles of
:mod:`autoq.cpu.amx_tiles`, started from ``-(zx + shift) * sum(w)`` (the compensation, one
row per channel) instead of zero. Each parallel task computes a run of consecutive blocks
(:func:`autoq.cpu.amx_tiles.task_run`) and issues a block's tile products before the previous
block's epilogue, so that they overlap (the tile store waits for the products to end): the
accumulators go through a stack buffer (two, alternating) and the epilogue, except where the
int32 tiles are the output: a complete block of a conv without horizontal padding
(``Wp == OW``) is stored straight into the NCHW output (row stride ``OH * OW``). With
horizontal padding every block is stored whole (int32 tiles straight, or 32-pixel vectors
after the epilogue) into an output over ``Wp``, whose rows are then cropped to ``OW`` by
vectorized copies: faster than copying each block's spans into the output on every padded
conv measured (int8 out, 1 thread: ResNet-50-1by2's 3x3 64 -> 64 at 28 x 28 70 -> 61 us,
256 -> 256 at 7 x 7 46 -> 41 us, PP-OCRv4 det's 96 -> 24 at 60 x 60 164 -> 154 us). Other
incomplete blocks (pixels past the last whole block, channels past OC) are copied out in
spans by fixed-width vectors (:func:`_copy_span`). A conv with one channel block and fewer
than 32 output channels narrows the lower tiles to its channels past 16 (24 channels: 8-row
tiles, a quarter fewer products). Packing skips the quads of channels past IC (they keep the
pad).

With a :class:`autoq.cpu.residual.Residual` (and an epilogue), each block adds the shortcut's
term to its accumulators on the stack before the epilogue (the residual add of a ResNet
bottleneck's last conv), the shortcut read NCHW or in its producer's blocked layout: the int32
sum is never written.
"""

from __future__ import annotations

from dataclasses import astuple, replace

import numpy as np
from tvm.script import tirx as T

from autoq.cpu.amx_tiles import (
    BLOCK,
    KSTEP,
    dot_block,
    intrin,
    load_config,
    load_rows,
    move_block,
    task_run,
)
from autoq.cpu.conv2d import ConvShape
from autoq.cpu.epilogue import Epilogue, drop_params, drop_table, table_shape, tail
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.packing import round_up
from autoq.cpu.residual import Residual, shortcut_load, shortcut_term

__all__ = [
    "AMX_POINTWISE_MAX_PIXELS",
    "amx_conv2d_kernel",
    "amx_conv_applies",
    "amx_conv_compensation",
    "amx_conv_weight",
    "amx_shortcut_shape",
    "tap_fold",
]

# a 1x1 conv with < 64 input channels runs on AMX only below this many output pixels
AMX_POINTWISE_MAX_PIXELS = 120 * 120


def tap_fold(in_channels: int, kernel_width: int) -> int:
    """Horizontal taps packed side by side in one 64-byte reduction row: as many copies of
    the input channels as fit (at most the kernel width), copy ``s`` shifted by ``s`` pixels,
    so that one ``tdpbsud`` covers taps ``kw .. kw + fold - 1``; channels in whole quads
    only (a copy is then its channels' packed rows shifted by ``4 s`` bytes).

    >>> tap_fold(32, 3), tap_fold(16, 3), tap_fold(64, 3), tap_fold(40, 3), tap_fold(16, 1)
    (2, 3, 1, 1, 1)
    >>> tap_fold(6, 3)  # not whole quads
    1
    """
    if in_channels % 4:
        return 1
    return max(1, min(kernel_width, KSTEP // in_channels))


def amx_conv_applies(shape: ConvShape) -> bool:
    """Dilation 1; stride 1, or a 1x1 kernel without padding at any stride (packing
    subsamples the image); at least 64 input channels, or fewer whose :func:`tap_fold`
    copies fill the 64-byte rows exactly (3x3 with 32: ResNet-50-1by2's first stage), or 16
    for 1x1 convs with 32 output channels or more and fewer than
    ``AMX_POINTWISE_MAX_PIXELS`` output pixels. Measured against the VNNI kernel
    (1 thread): 3x3 with 32-40 input channels without folding 0.74-0.96x (the tile rows are
    half padding), 1x1 with 16-32 input channels 1.8-4.7x on small images
    (output-bound: AMX stores complete tiles straight into NCHW) but 1.3-1.5x SLOWER at
    240x240 (memory-bound; the channels are padded to 64 in the packed image), even at
    120x120 (0.9-1.3x), 1x1 with 16 output channels 0.1x (no complete tile: every block goes
    through the stack buffer)."""
    pointwise = shape.kernel == (1, 1) and not any(shape.padding)
    oh, ow = shape.out_hw
    folded = shape.in_channels * tap_fold(shape.in_channels, shape.kernel[1]) == KSTEP
    wide = (
        shape.in_channels >= 64
        or (folded and not pointwise)
        or (
            pointwise
            and shape.in_channels >= 16
            and shape.out_channels >= 32
            and oh * ow < AMX_POINTWISE_MAX_PIXELS
        )
    )
    return (shape.strides == (1, 1) or pointwise) and shape.dilation == (1, 1) and wide


def _subsampled(shape: ConvShape) -> ConvShape:
    """A strided 1x1 conv as the stride-1 conv of the pixels it reads (others: unchanged)."""
    if shape.strides == (1, 1):
        return shape
    oh, ow = shape.out_hw
    return replace(shape, height=oh, width=ow, strides=(1, 1))


def fold_taps(w: np.ndarray) -> np.ndarray:
    """OIHW weights with their :func:`tap_fold` horizontal taps as input channels:
    ``[OC, fold * IC, KH, ceil(KW / fold)]``, channel ``s * IC + c`` of column ``j`` = tap
    ``j * fold + s`` of channel ``c`` (zero past the kernel width).

    >>> w = np.arange(12).reshape(1, 4, 1, 3).astype(np.int8) + 1  # tap j of c: 3 c + j + 1
    >>> fold_taps(w)[0, :, 0, 0].tolist()  # 4 channels: fold 3, the 3 taps in one column
    [1, 4, 7, 10, 2, 5, 8, 11, 3, 6, 9, 12]
    >>> fold_taps(np.ones((1, 32, 1, 3), np.int8))[0, 32:, 0, 1].tolist() == [0] * 32
    True
    """
    oc, ic, kh, kw = w.shape
    fold = tap_fold(ic, kw)
    cols = -(-kw // fold)
    wide = np.zeros((oc, ic, kh, cols * fold), w.dtype)
    wide[..., :kw] = w
    wide = wide.reshape(oc, ic, kh, cols, fold).transpose(0, 4, 1, 2, 3)
    return np.ascontiguousarray(wide.reshape(oc, fold * ic, kh, cols))


def amx_conv_weight(w: np.ndarray) -> np.ndarray:
    """OIHW int8 weights as ``[OCp/16, KH*KW*ICp/64, 16, 64]``: 16 output channels x 64
    reduction bytes (one tap, 64 input channels) per tile, OC padded to 32, IC to 64; the
    taps folded first (:func:`fold_taps`).

    >>> p = amx_conv_weight(np.arange(2 * 3).reshape(2, 3, 1, 1).astype(np.int8))
    >>> p.shape, p[0, 0, 1, :4].tolist()  # output channel 1: its 3 input channels, then 0
    ((2, 1, 16, 64), [3, 4, 5, 0])
    >>> amx_conv_weight(np.ones((32, 32, 3, 3), np.int8)).shape  # 2 taps a row: 3 x 2 of 9
    (2, 6, 16, 64)
    """
    oc, ic, kh, kw = (w := fold_taps(w)).shape
    icp, ocp = round_up(ic, KSTEP), round_up(oc, BLOCK)
    wt = np.zeros((ocp, kh, kw, icp), np.int8)
    wt[:oc, ..., :ic] = w.transpose(0, 2, 3, 1)
    steps = kh * kw * icp // KSTEP
    return np.ascontiguousarray(wt.reshape(ocp // 16, 16, steps, KSTEP).transpose(0, 2, 1, 3))


def amx_conv_compensation(w: np.ndarray, zero_point: int) -> np.ndarray:
    """The accumulators' start ``-zero_point * sum(w)`` as ``[OCp, 16]`` int32 (one row of 16
    equal columns per output channel: a tile load with a 64-byte row stride).

    >>> amx_conv_compensation(np.ones((2, 3, 1, 1), np.int8), 5)[:3, :2].tolist()
    [[-15, -15], [-15, -15], [0, 0]]
    """
    sums = w.reshape(w.shape[0], -1).astype(np.int64).sum(axis=1) * -zero_point
    out = np.zeros((round_up(w.shape[0], BLOCK), 16), np.int32)
    out[: w.shape[0]] = sums.astype(np.int32)[:, None]
    return out


def _geometry(shape: ConvShape) -> tuple[int, int, int, int, int]:
    """(ICp of the folded channels, OCp, padded width Wp, output pixels over Wp, packed
    pixels any tile may read)."""
    (kh, kw), (_, pl, _, pr), (oh, _) = shape.kernel, shape.padding, shape.out_hw
    wp = shape.width + pl + pr
    m = oh * wp
    pix = -(-(round_up(m, BLOCK) + (kh - 1) * wp + kw - 1) // wp) * wp
    icp = round_up(shape.in_channels * tap_fold(shape.in_channels, kw), KSTEP)
    return icp, round_up(shape.out_channels, BLOCK), wp, m, pix


def amx_shortcut_shape(residual: Residual | None, n_img: int, oc: int, oh: int, ow: int):
    """(shape, dtype) the kernel reads a residual's shortcut in: its NCHW or blocked shape
    with the pixels flattened (``[N, C, OH * OW]`` / ``[N, C / b, OH * OW, b]``, a reshape
    of the tensor); a dummy without a residual.

    >>> amx_shortcut_shape(None, 1, 8, 2, 3)
    ((1, 1, 1), 'int8')
    """
    if residual is None:
        return (1, 1, 1), "int8"
    lay = residual.layout
    if lay is None:
        return (n_img, oc, oh * ow), residual.dtype
    n, cb, _, _, b = lay.shape(n_img, oc, oh, ow)
    return (n, cb, oh * ow, b), lay.dtype


def amx_conv2d_kernel(
    shape: ConvShape,
    data_dtype: str,
    shift: int,
    pad_value: int,
    epilogue: Epilogue | None = None,
    residual: Residual | None = None,
):
    """The PrimFunc ``(data[N, C, H, W], packed_weight, compensation[OCp, 16][, shortcut
    (:func:`amx_shortcut_shape`), residual table][, table], out)``: see the module doc;
    with an ``epilogue``, blocks are requantized from the stack buffer (with a
    ``residual``, after adding its term)."""
    if residual is not None and epilogue is None:
        raise ValueError("amx_conv2d_kernel: a residual needs an epilogue")
    out_dtype, finish = "int32" if epilogue is None else epilogue.out_dtype, tail(epilogue)
    in_hw, (sh, sw), shape = (shape.height, shape.width), shape.strides, _subsampled(shape)
    n_img, ic, h, wd, oc = astuple(shape)[:5]
    (kh, kw), (pt, pl, _, _), (oh, ow) = shape.kernel, shape.padding, shape.out_hw
    icp, ocp, wp, m, pix = _geometry(shape)
    fold = tap_fold(ic, kw)
    cols = -(-kw // fold)  # tap columns of the folded weights
    row_blocks, chunks, quads = round_up(m, BLOCK) // BLOCK, icp // KSTEP, icp // 4
    cblocks = ocp // BLOCK
    # units (image, pixel block, channel block), channel blocks fastest, in runs of `run`
    units, run = n_img * row_blocks * cblocks, task_run(n_img * row_blocks, cblocks)
    direct, spans = wp == ow and epilogue is None, -(-BLOCK // wp) + 1
    low_rows = min(max(oc - 16, 1), 16) if ocp == BLOCK else 16
    # horizontal padding: every block is stored whole into an output over Wp (channels
    # padded to OCp, pixels to whole blocks), cropped to OW afterwards by vectorized rows
    cropped, mp = wp != ow, round_up(m, BLOCK)
    wide_shape = (n_img, ocp, mp) if cropped else (1, 1, 1)
    stored = cropped and epilogue is None
    s_shape, s_dtype = amx_shortcut_shape(residual, n_img, oc, oh, ow)
    r_shape = (1, 1) if residual is None else residual.shortcut.table().shape

    def add(v, ch, sf, r, img, p, last):
        """The accumulator ``v`` of channel ``ch``, output pixel ``p`` over ``Wp`` (clamped to
        ``last`` unless None), plus the shortcut term (``v`` itself without a residual)."""
        if residual is None:
            return v
        p = p if last is None else T.min(p, last)
        if wp != ow:  # the output pixel (y, x) of p, columns past OW clamped (dropped later)
            p = T.min(p // wp, oh - 1) * ow + T.min(p % wp, ow - 1)
        return v + shortcut_term(residual, shortcut_load(residual, sf, img, ch, (p,)), ch, r)

    @T.prim_func
    def amx_conv2d(
        x: T.Buffer((n_img, ic, *in_hw), data_dtype),
        w: T.Buffer((ocp // 16, kh * cols * chunks, 16, KSTEP), "int8"),
        c: T.Buffer((ocp, 16), "int32"),
        s: T.Buffer(s_shape, s_dtype),
        r: T.Buffer(r_shape, "int32"),
        e: T.Buffer(table_shape(epilogue, oc), "int32"),
        out: T.Buffer((n_img, oc, oh, ow), out_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        a = T.decl_buffer((n_img, quads, pix, 4), "uint8")
        a_flat = T.decl_buffer((n_img * quads, pix * 4), "uint8", data=a.data)
        flat = T.decl_buffer((n_img, oc, oh * ow), out_dtype, data=out.data)
        wide = T.decl_buffer(wide_shape, out_dtype)
        for nq in T.parallel(n_img * quads):
            for b in range(pix * 4):
                a_flat[nq, b] = T.uint8(pad_value)
            # channels >= ic meet zero weights: any value will do (quads past ic keep the pad;
            # so do the folded copies, until the next loop)
            if nq % quads * 4 < ic:
                for y, xx in T.grid(h, wd):
                    for r4 in T.unroll(4):
                        a[nq // quads, nq % quads, (y + pt) * wp + pl + xx, r4] = T.Cast(
                            "uint8",
                            T.Cast(
                                "int32",
                                x[nq // quads, T.min(nq % quads * 4 + r4, ic - 1), y * sh, xx * sw],
                            )
                            + shift,
                        )
        if fold > 1:  # folded tap copy s of a quad: its packed row, s pixels left
            for nq in T.parallel(n_img * (fold - 1) * ic // 4):
                _shift_row(a_flat, nq // (ic // 4 * (fold - 1)) * quads, nq % (ic // 4), ic // 4,
                           nq // (ic // 4) % (fold - 1) + 1, pix * 4)  # fmt: skip
        for st in T.parallel(-(-units // run)):
            cfg = T.decl_buffer((64,), "uint8", scope="local")
            acc = T.decl_buffer((2, BLOCK, BLOCK), "int32", scope="local")
            blk = T.decl_buffer((BLOCK, BLOCK), out_dtype, scope="local")
            load_config(cfg, KSTEP, low_rows)
            for k in range(run + 1):
                u = st * run + k  # this step's unit; the previous one's epilogue runs after
                img = u // (row_blocks * cblocks)  # this unit's products are issued
                p0 = u // cblocks % row_blocks * BLOCK
                c0 = u % cblocks * BLOCK
                if k < run and u < units:
                    load_rows(c, c0)  # start: the compensation
                    for tap, ch in T.grid(kh * cols, chunks):
                        pt0 = p0 + tap // cols * wp + tap % cols * fold
                        dot_block(
                            T.address_of(w[c0 // 16, tap * chunks + ch, 0, 0]),
                            T.address_of(w[c0 // 16 + 1, tap * chunks + ch, 0, 0]),
                            KSTEP,
                            T.address_of(a[img, ch * 16, pt0, 0]),
                            T.address_of(a[img, ch * 16, pt0 + 16, 0]),
                            pix * 4,
                            "llvm.x86.tdpbsud",
                        )
                if 0 < k and u - 1 < units:
                    img1 = (u - 1) // (row_blocks * cblocks)
                    p1 = (u - 1) // cblocks % row_blocks * BLOCK
                    c1 = (u - 1) % cblocks * BLOCK
                    if not (stored or (direct and p1 + BLOCK <= m and c1 + BLOCK <= oc)):
                        _emit_block(
                            flat, wide, blk, acc, T.bitwise_and(k + 1, 1), c1, oc, e, finish, add,
                            s, r, img1, p1, m, wp, ow, spans, residual is not None, cropped,
                        )  # fmt: skip
                if k < run and u < units:
                    if stored:  # int32 over Wp: every block whole
                        _store_direct(wide, img, c0, p0, mp * 4)
                    elif direct and p0 + BLOCK <= m and c0 + BLOCK <= oc:  # complete int32 block
                        _store_direct(flat, img, c0, p0, oh * ow * 4)
                    else:
                        _store_slot(acc, T.bitwise_and(k, 1))
            T.evaluate(intrin("llvm.x86.tilerelease"))
        if cropped:
            for nc in T.parallel(n_img * oc):
                for y in range(oh):
                    for xx in T.vectorized(ow):
                        out[nc // oc, nc % oc, y, xx] = wide[nc // oc, nc % oc, y * wp + xx]

    func = amx_conv2d if residual is not None else drop_params(amx_conv2d, (3, 4))
    func = drop_table(func, epilogue, 3 if residual is None else 5)
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


_CORNERS = ((0, 0), (0, 16), (16, 0), (16, 16))


@T.macro
def _shift_row(a_flat, q0, q, copy_quads, s, row):
    """Packed row ``q0 + q + s * copy_quads`` = row ``q0 + q`` from byte ``4 s`` on (64-byte
    vectors, the last one overlapping; its last ``4 s`` bytes keep the pad)."""
    for c in range(-(-(row - 4 * s) // 64)):
        for j in T.vectorized(64):
            a_flat[q0 + q + s * copy_quads, T.min(c * 64, row - 4 * s - 64) + j] = a_flat[
                q0 + q, T.min(c * 64, row - 4 * s - 64) + 4 * s + j
            ]


@T.macro
def _finish_block(q, acc, slot, c0, oc, e, finish, add, sf, r, img, p0, last):
    """``q`` = the stack block ``acc`` through ``add`` (the shortcut term of pixel
    ``p0 + j``, at most ``last`` unless None) and ``finish`` (the epilogue), vectorized over
    the 32 pixels of a channel row; the rows of channels past ``oc`` are left as they are."""
    for i in range(T.min(BLOCK, oc - c0)):
        for j in T.vectorized(BLOCK):
            q[i, j] = finish(add(acc[slot, i, j], c0 + i, sf, r, img, p0 + j, last), c0 + i, e)


@T.macro
def _copy_block(flat, blk, img, c0, p0):
    """A complete block of pixels that are consecutive in the output (no horizontal padding)."""
    for i in range(BLOCK):
        for j in T.vectorized(BLOCK):
            flat[img, c0 + i, p0 + j] = blk[i, j]


@T.macro
def _copy_two(flat, blk, img, ch, i, d, s, n, width):
    for j in T.vectorized(width):
        flat[img, ch, d + j] = blk[i, s + j]
    for j in T.vectorized(width):
        flat[img, ch, d + n - width + j] = blk[i, s + n - width + j]


@T.macro
def _copy_span(flat, blk, img, ch, i, d, s, n):
    """``flat[img, ch, d:d + n] = blk[i, s:s + n]`` for ``n <= 32``: two fixed-width vector
    copies that overlap (the first and the last 16, 8 or 4 elements), single elements
    under 4."""
    if n >= 16:
        _copy_two(flat, blk, img, ch, i, d, s, n, 16)
    elif n >= 8:
        _copy_two(flat, blk, img, ch, i, d, s, n, 8)
    elif n >= 4:
        _copy_two(flat, blk, img, ch, i, d, s, n, 4)
    else:
        for j in range(n):
            flat[img, ch, d + j] = blk[i, s + j]


@T.macro
def _emit_block(
    flat, wide, blk, acc, slot, c0, oc, e, finish, add, sf, r, img, p0, m, wp, ow, spans, res,
    cropped,
):  # fmt: skip
    """The stored block ``acc[slot]`` of channels ``c0..``, pixels ``p0..`` through the
    epilogue into the output (``cropped``: whole into ``wide``, over ``Wp``)."""
    # a complete block (every pixel inside the output rows) reads the shortcut without
    # clamping; without a residual nothing is read
    if res and p0 + BLOCK <= m:
        _finish_block(blk, acc, slot, c0, oc, e, finish, add, sf, r, img, p0, None)
    else:
        _finish_block(blk, acc, slot, c0, oc, e, finish, add, sf, r, img, p0, m - 1)
    if cropped:
        _copy_block(wide, blk, img, c0, p0)
    elif wp == ow and p0 + BLOCK <= m and c0 + BLOCK <= oc:  # contiguous rows
        _copy_block(flat, blk, img, c0, p0)
    else:
        for i, yb in T.grid(T.min(BLOCK, oc - c0), spans):
            y = p0 // wp + yb  # output row (spans: rows a block touches)
            lo = T.max(p0, y * wp)
            hi = T.min(T.min(p0 + BLOCK, y * wp + ow), m)
            d, n = y * ow + lo - y * wp, T.max(hi - lo, 0)
            _copy_span(flat, blk, img, c0 + i, i, d, lo - p0, n)


def _store_direct(flat, img, c0, p0, stride):
    """The int32 accumulators straight into the output (channels c0.., pixels p0..)."""
    ptrs = [T.address_of(flat[img, c0 + i, p0 + j]) for i, j in _CORNERS]
    move_block("llvm.x86.tilestored64", ptrs, stride)


def _store_slot(acc, slot):
    """The accumulators into the stack block ``acc[slot]``."""
    ptrs = [T.address_of(acc[slot, i, j]) for i, j in _CORNERS]
    move_block("llvm.x86.tilestored64", ptrs, BLOCK * 4)
