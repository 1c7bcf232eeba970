"""int8 conv2d with few input channels (an image's stem: 7x7 stride 2, 3 -> 64) on Intel AMX
tiles, as an implicit GEMM over taps packed im2col-style, channels x pixels.

:mod:`autoq.cpu.amx_conv2d` reduces over 64 input channels of one tap per tile row: an RGB
image would fill 3 of the 64 bytes. Here a tile row reduces over taps instead: the reduction
is numbered ``(c, kh, kw)`` with the kernel width padded to quads (``KWq = ceil(KW / 4)``
quads of 4 horizontal taps; the padded taps meet zero weights), ``Q = IC * KH * KWq`` quads in
all, padded to a multiple of 16 (whole 64-byte steps; a reduction of at most 64 bytes is
one step of exactly its depth, the tiles narrowed by the configuration).

The image is copied once, shifted (``x + 128`` for int8 data) and padded with the shifted
zero point, into ``[IC, Hp, Wx]`` rows. Output pixels are numbered over the width padded to
16, ``p = oy * OWp + ox``, so 16 consecutive pixels share an output row; the column tile of
16 pixels x quad ``(c, kh, q)`` is then one 64-byte permutation of the image row
``c, oy * sh + kh`` from column ``ox0 * sw + 4 q`` (pixel ``j``, byte ``t`` at ``j * sw +
t``: :func:`window_indices`, one ``vpermb``). Per block of 32 pixels the ``Q`` quads are
packed once into a ``[Q, 32, 4]`` stack buffer and feed every 32-channel block; the
weights are the row operand ``[OCp/16, steps, 16, 64]`` (:func:`strided_conv_weight`), the
accumulators start from :func:`autoq.cpu.amx_conv2d.amx_conv_compensation`, and each block
goes through the stack and the epilogue into NCHW (columns ``ox >= OW`` dropped).

The process must have been granted the tile state (:func:`autoq.cpu.amx.require_amx`).
"""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autoq.cpu import amx_tiles as tiles
from autoq.cpu.amx_tiles import BLOCK, KSTEP
from autoq.cpu.conv2d import ConvShape
from autoq.cpu.epilogue import Epilogue, drop_table, table_shape, tail
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.packing import round_up

__all__ = [
    "MAX_IN_CHANNELS",
    "amx_strided_conv2d_kernel",
    "amx_strided_conv_applies",
    "strided_conv_weight",
    "window_indices",
]

# input channels up to which taps, not channels, fill the tile rows
MAX_IN_CHANNELS = 4
_GROUP = 16  # pixels of a column tile
_MAX_STRIDE = 4  # 16 pixels at this column stride still fit one 64-byte load


def amx_strided_conv_applies(shape: ConvShape) -> bool:
    """Dilation 1, at most ``MAX_IN_CHANNELS`` input channels, a column stride of at most 4
    and at least 32 output channels (one complete channel block). Measured (1 thread, CPU
    time): ResNet-50's 7x7/2 3 -> 64 stem at 224 x 224 0.34 vs 0.76 ms for the VNNI kernel;
    YOLOv8n's 3x3/2 3 -> 16 stem, on AMX with 1-row lower tiles, 0.15 vs 0.29 ms alone but
    not faster end to end (the AMX unit starts cold there, and the stem's VNNI neighbour
    loses its blocked input)."""
    return (
        shape.in_channels <= MAX_IN_CHANNELS
        and shape.dilation == (1, 1)
        and shape.strides[1] <= _MAX_STRIDE
        and shape.out_channels >= BLOCK
    )


def _quads(shape: ConvShape) -> tuple[int, int, int]:
    """(quads of a kernel row ``KWq``, real quads ``IC * KH * KWq``, reduction depth of a step)."""
    kwq = -(-shape.kernel[1] // 4)
    q = shape.in_channels * shape.kernel[0] * kwq
    return kwq, q, min(4 * q, KSTEP)


def window_indices(stride: int) -> list[int]:
    """The byte of a 64-byte image row window each byte of a column tile row takes: pixel
    ``j``'s four taps are the window's bytes ``j * stride .. j * stride + 3``.

    >>> window_indices(2)[:10]
    [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    """
    return [j * stride + t for j in range(_GROUP) for t in range(4)]


def strided_conv_weight(w: np.ndarray) -> np.ndarray:
    """OIHW int8 weights as the row operand ``[OCp/16, steps, 16, 64]``: output channels
    padded to 32, the reduction ``(c, kh, kw)`` with the kernel width padded to quads and the
    whole padded to the steps' depth (zeros).

    >>> p = strided_conv_weight(np.arange(2 * 5).reshape(2, 1, 1, 5).astype(np.int8))
    >>> p.shape, p[0, 0, 1, :9].tolist()  # channel 1: its 5 taps, 3 padded taps, then 0
    ((2, 1, 16, 64), [5, 6, 7, 8, 9, 0, 0, 0, 0])
    """
    oc, ic, kh, kw = w.shape
    kwq = -(-kw // 4)
    depth = 4 * ic * kh * kwq
    kp = depth if depth <= KSTEP else round_up(depth, KSTEP)
    ocp = round_up(oc, BLOCK)
    wt = np.zeros((ocp, ic, kh, 4 * kwq), np.int8)
    wt[:oc, ..., :kw] = w
    flat = np.zeros((ocp, max(kp, KSTEP)), np.int8)
    flat[:, :depth] = wt.reshape(ocp, depth)
    steps = max(kp, KSTEP) // KSTEP
    return np.ascontiguousarray(flat.reshape(ocp // 16, 16, steps, KSTEP).transpose(0, 2, 1, 3))


def amx_strided_conv2d_kernel(
    shape: ConvShape,
    data_dtype: str,
    shift: int,
    pad_value: int,
    epilogue: Epilogue | None = None,
):
    """The PrimFunc ``(data[N, C, H, W], packed_weight (:func:`strided_conv_weight`),
    compensation[OCp, 16][, table], out)``: see the module doc; with an ``epilogue``,
    blocks are requantized from the stack buffer."""
    if not amx_strided_conv_applies(shape):
        raise ValueError(f"amx_strided_conv2d_kernel: not a shape it covers: {shape}")
    out_dtype, finish = "int32" if epilogue is None else epilogue.out_dtype, tail(epilogue)
    n_img, ic, h, wd, oc = astuple(shape)[:5]
    kh, (sh, sw), (pt, pl, _, _) = shape.kernel[0], shape.strides, shape.padding
    oh, ow = shape.out_hw
    kwq, nq, depth = _quads(shape)
    steps = max(1, -(-4 * nq // KSTEP))
    qp = steps * depth // 4  # quads of the packed buffer (the last step's padding: zeros)
    owp = round_up(ow, _GROUP)
    m = oh * owp
    row_blocks = round_up(m, BLOCK) // BLOCK
    ocp = round_up(oc, BLOCK)
    cblocks = ocp // BLOCK
    hp = (oh - 1) * sh + kh  # image rows read
    wx = (owp - _GROUP) * sw + 4 * (kwq - 1) + KSTEP  # columns a 64-byte window may read
    units = n_img * row_blocks
    run = tiles.task_run(units, 1)
    ncopy = min(wd, wx - pl)  # image columns a window may read
    idx = [tirx.IntImm("int32", i) for i in window_indices(sw)]

    @T.prim_func
    def amx_strided_conv2d(
        x: T.Buffer((n_img, ic, h, wd), data_dtype),
        w: T.Buffer((ocp // 16, steps, 16, KSTEP), "int8"),
        c: T.Buffer((ocp, 16), "int32"),
        e: T.Buffer(table_shape(epilogue, oc), "int32"),
        out: T.Buffer((n_img, oc, oh, ow), out_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        xp = T.decl_buffer((n_img, ic, hp, wx), "uint8")
        flat = T.decl_buffer((n_img, oc, oh * ow), out_dtype, data=out.data)
        for r in T.parallel(n_img * ic * hp):
            for b in T.vectorized(wx):
                xp[r // (ic * hp), r // hp % ic, r % hp, b] = T.uint8(pad_value)
            y = r % hp - pt
            if 0 <= y and y < h:
                for xx in T.vectorized(ncopy):
                    xp[r // (ic * hp), r // hp % ic, r % hp, pl + xx] = T.Cast(
                        "uint8", T.Cast("int32", x[r // (ic * hp), r // hp % ic, y, xx]) + shift
                    )
        for st in T.parallel(-(-units // run)):
            cfg = T.decl_buffer((64,), "uint8", scope="local")
            act = T.decl_buffer((qp * BLOCK * 4,), "uint8", scope="local")
            acc = T.decl_buffer((BLOCK, BLOCK), "int32", scope="local")
            tiles.load_config(cfg, depth)
            for b in T.vectorized(qp * BLOCK * 4):
                act[b] = T.uint8(0)  # the padding quads (zero weights) stay 0
            for u in range(st * run, T.min(st * run + run, units)):
                img = u // row_blocks
                p0 = u % row_blocks * BLOCK
                for g, q in T.grid(2, nq):
                    # group g's output row and first column (rows past OH: the last one's)
                    oy = T.min((p0 + g * _GROUP) // owp, oh - 1)
                    ox0 = (p0 + g * _GROUP) % owp
                    row = oy * sh + q // kwq % kh
                    col = ox0 * sw + q % kwq * 4
                    act[T.Ramp((q * BLOCK + g * _GROUP) * 4, 1, KSTEP)] = tirx.Shuffle(
                        [xp[img, q // (kwq * kh), row, T.Ramp(col, 1, KSTEP)]], idx
                    )
                for cb in range(cblocks):
                    tiles.load_rows(c, cb * BLOCK)  # start: the compensation
                    for s in range(steps):
                        tiles.dot_block(
                            T.address_of(w[cb * 2, s, 0, 0]),
                            T.address_of(w[cb * 2 + 1, s, 0, 0]),
                            KSTEP,
                            T.address_of(act[s * depth * BLOCK]),
                            T.address_of(act[s * depth * BLOCK + _GROUP * 4]),
                            BLOCK * 4,
                            "llvm.x86.tdpbsud",
                        )
                    tiles.store_block(acc)
                    _emit(flat, acc, cb * BLOCK, oc, e, finish, img, p0, m, owp, ow)
            T.evaluate(tiles.intrin("llvm.x86.tilerelease"))

    func = drop_table(amx_strided_conv2d, epilogue, 3)
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


@T.macro
def _emit(flat, acc, c0, oc, e, finish, img, p0, m, owp, ow):
    """The stack block ``acc`` (channels ``c0..``, pixels ``p0..`` over the width ``owp``)
    through the epilogue into the NCHW output, by groups of 16 pixels of one row: 16-lane
    vectors for a whole group, single values for the columns of a group cut at ``OW``."""
    for g in T.unroll(2):
        p = p0 + g * _GROUP
        d = p // owp * ow + p % owp
        if p < m:
            if p % owp + _GROUP <= ow:
                for i in range(T.min(BLOCK, oc - c0)):
                    for j in T.vectorized(_GROUP):
                        flat[img, c0 + i, d + j] = finish(acc[i, g * _GROUP + j], c0 + i, e)
            else:
                for i, j in T.grid(T.min(BLOCK, oc - c0), ow - p % owp):
                    flat[img, c0 + i, d + j] = finish(acc[i, g * _GROUP + j], c0 + i, e)
