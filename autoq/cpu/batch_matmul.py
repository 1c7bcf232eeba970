"""int8 matmul of two activations (``qnn.matmul``: attention's ``q @ k^T`` and ``p @ v``) as a
packed, tensorized PrimFunc with a fixed schedule, batched over the leading axes (the heads).

Both operands arrive at run time, so both are packed inside the kernel, once per call and
batch entry (head), right before that head's tiles read them: the left one like
:mod:`autoq.cpu.dense` packs its activations (``a + shift`` in the ISA's activation dtype), the
right one into the ISA's weight blocks ``[N/L, K/k, L, k]`` (VNNI: the int8 values as they
are; AVX2: ``b - zb`` in int16, exact). The zero points are a run-time input ``[za, zb]``
(:func:`matmul_zero_points`) and the requantize values the epilogue's table, so layers of one
shape share one compiled kernel. With ``A' = a + sa`` and ``B' = b + sb`` the result is

``sum((a - za)(b - zb)) = sum(A'B') - zb' * sum(A') - za' * sum(B') + K * za' * zb'``

where ``za' = za + sa`` and ``zb' = zb + sb``: on AVX2 both are 0 (``sa = -za``, ``sb = -zb``:
no correction), on VNNI ``sa`` is 128 for int8 data and 0 for uint8, ``sb = 0``. On VNNI the
row sums of ``A'`` and column sums of ``B`` are computed per head next to the packing, and
each output tile gets its three correction terms (:func:`start`) as it is finished
(requantized, stored) right after its accumulation, in registers: no int32 tensor is
written. (TE's ``te.sum(init=...)`` would make them the accumulator's starting value, but
``create_prim_func`` drops a reduction's init.) Everything is int32 and exact.

>>> start(VNNI, 32, 3, -5, 128, 4000, -70)
8210
>>> start(AVX2, 32, 3, -5, -3, 4000, -70)
0
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq import primitives as P
from autoq.cpu.epilogue import Epilogue, epilogue_compute
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.isa import AVX2, VNNI, Isa  # noqa: F401  (VNNI/AVX2: doctest)
from autoq.cpu.packing import round_up
from autoq.cpu.tiling import i64, int32, pick_tile, tensorize_accumulation

__all__ = ["accumulator_bound", "batch_matmul_kernel", "matmul_zero_points", "start"]


def matmul_zero_points(za: int, zb: int) -> np.ndarray:
    """The int32 ``[za, zb]`` operand of :func:`batch_matmul_kernel`.

    >>> matmul_zero_points(3, -9).tolist()
    [3, -9]
    """
    return np.array([za, zb], np.int32)


def start(isa: Isa, k_dim: int, za, zb, shift, row_sum, col_sum):
    """The correction added to ``sum(A'B')`` (see the module docstring): ``K za' zb' - zb' *
    row_sum - za' * col_sum`` with ``za' = za + shift`` and ``zb' = zb`` on VNNI; 0 on AVX2
    (centered operands). Works on ints and on TIR int32 expressions alike."""
    if isa.centered:
        return 0
    za2 = za + shift
    return k_dim * za2 * zb - zb * row_sum - za2 * col_sum


def accumulator_bound(k_dim: int, a_dtype: str, za: int, zb: int) -> int:
    """The largest ``|sum_k((a - za)(b - zb))|`` over ``a_dtype`` ``a`` and int8 ``b``.

    >>> accumulator_bound(32, "int8", 0, 0), accumulator_bound(2, "uint8", 3, -9)
    (524288, 68544)
    """
    lo, hi = P.qrange(a_dtype)
    return k_dim * max(abs(lo - za), abs(hi - za)) * max(abs(-128 - zb), abs(127 - zb))


def _pack_b(b, batch: int, k_dim: int, n: int, isa: Isa, zb):
    lanes, k = isa.lanes, isa.k
    kp, np_ = round_up(k_dim, k), isa.padded_channels(n)

    def pack(t, o, c, oi, ci):
        kk, nn = c * k + ci, o * lanes + oi
        value = int32(b[t, kk, nn]) - zb if isa.centered else int32(b[t, kk, nn])
        inside = tirx.all(kk < k_dim, nn < n)
        return tirx.if_then_else(
            inside, value.astype(isa.weight_dtype), tirx.const(0, isa.weight_dtype)
        )

    return te.compute((batch, np_ // lanes, kp // k, lanes, k), pack, name="autoq_pack_b")


def _shift(isa: Isa, a_dtype: str, za):
    """``sa``: a constant on VNNI, ``-za`` (run time) on AVX2."""
    return -za if isa.centered else isa.shift(a_dtype, 0)


def _sums(isa: Isa, a, b, batch, m, k_dim, n, shift):
    """(row sums of ``A'``, column sums of ``B``) [batch, m] / [batch, n] int32 (VNNI), or
    (None, None) (AVX2)."""
    if isa.centered:
        return None, None
    r1, r2 = te.reduce_axis((0, k_dim), "r1"), te.reduce_axis((0, k_dim), "r2")
    rows = te.compute(
        (batch, m), lambda t, i: te.sum(int32(a[t, i, r1]) + shift, axis=r1), name="autoq_rowsum"
    )
    cols = te.compute(
        (batch, n), lambda t, j: te.sum(int32(b[t, r2, j]), axis=r2), name="autoq_colsum"
    )
    return rows, cols


def _compute(batch, m, k_dim, n, isa: Isa, a_dtype: str, epi, bound):
    lanes, k = isa.lanes, isa.k
    tile = pick_tile(m, isa.max_tile)
    mp, kp, np_ = round_up(m, tile), round_up(k_dim, k), isa.padded_channels(n)
    a = te.placeholder(i64(batch, m, k_dim), a_dtype, name="lhs")
    b = te.placeholder(i64(batch, k_dim, n), "int8", name="rhs")
    zp = te.placeholder((2,), "int32", name="zero_points")
    za, zb = zp[0], zp[1]
    shift = _shift(isa, a_dtype, za)

    def pack_a(t, i, j):
        value = (int32(a[t, i, j]) + shift).astype(isa.act_dtype)
        inside = tirx.all(i < m, j < k_dim)
        return tirx.if_then_else(inside, value, tirx.const(0, isa.act_dtype))

    pa = te.compute((batch, mp, kp), pack_a, name="autoq_pack")
    pb = _pack_b(b, batch, k_dim, n, isa, zb)
    rows, cols = _sums(isa, a, b, batch, m, k_dim, n, shift)

    rc, rk = te.reduce_axis((0, kp // k), "rc"), te.reduce_axis((0, k), "rk")
    acc = te.compute(
        (batch, mp, np_ // lanes, lanes),
        lambda t, i, o, oi: te.sum(
            int32(pa[t, i, rc * k + rk]) * int32(pb[t, o, rc, oi, rk]), axis=[rc, rk]
        ),
        name="autoq_acc",
    )
    inputs = [a, b, zp]

    def value(t, i, j):
        v = acc[t, i, j // lanes, j % lanes]
        return v if rows is None else v + start(isa, k_dim, za, zb, shift, rows[t, i], cols[t, j])

    out = epilogue_compute((batch, m, n), value, 2, epi, inputs, bound)  # int32 loops: tensorize
    return [*inputs, out], tile


def batch_matmul_kernel(
    batch: int,
    m: int,
    k: int,
    n: int,
    isa: Isa,
    a_dtype: str,
    epilogue: Epilogue | None = None,
    zero_points: tuple[int, int] | None = None,
):
    """The scheduled PrimFunc ``(lhs[batch, m, k], rhs[batch, k, n] int8, zero_points[2]
    int32[, table], out[batch, m, n])`` of ``(lhs - za) @ (rhs - zb)`` in int32 (or, with an
    ``epilogue``, requantized to int8/uint8), ``zero_points`` = :func:`matmul_zero_points`;
    parallel over the batch (each head packs and sums its operands, then runs its tiles).
    ``zero_points``: the ``(za, zb)`` the kernel will be called with, when known: they bound
    the accumulator (:func:`accumulator_bound`), which may let the epilogue requantize in
    float64 (:meth:`autoq.cpu.epilogue.Epilogue.exact_in_float64`)."""
    bound = None if zero_points is None else accumulator_bound(k, a_dtype, *zero_points)
    tensors, tile = _compute(batch, m, k, n, isa, a_dtype, epilogue, bound)
    sch = Schedule(te.create_prim_func(tensors))
    # the output's (head, row tile, column tile) loops are the kernel's; each tile's
    # accumulation is computed right before the tile is stored
    out = sch.get_sblock("autoq_out")
    t, i, j = sch.get_loops(out)
    blocks = isa.channel_blocks(n)
    io, ii = sch.split(i, [None, tile])
    jo, jb, jl = sch.split(j, [None, blocks, isa.lanes])
    sch.reorder(t, io, jo, ii, jb, jl)
    sch.vectorize(jl)
    block = sch.get_sblock("autoq_acc")
    sch.compute_at(block, jo, preserve_unit_loops=True)
    ai, ao, aoi, rc, rk = sch.get_loops(block)[-5:]
    sch.reorder(rc, ai, ao, aoi, rk)
    sch.unroll(ai)
    sch.unroll(ao)
    names = ["autoq_pack", "autoq_pack_b"] + ["autoq_rowsum", "autoq_colsum"] * (not isa.centered)
    for name in names:
        sch.compute_at(sch.get_sblock(name), t)
    sch.parallel(t)
    tensorize_accumulation(sch, block, rc, aoi, isa.intrinsic)
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
