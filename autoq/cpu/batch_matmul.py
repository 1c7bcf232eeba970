"""int8 matmul of two activations (``qnn.matmul``: attention's ``q @ k^T``) as a packed,
tensorized PrimFunc with a fixed schedule, batched over the leading axes (the heads).

Both operands arrive at run time, so both are packed inside the kernel, once per call: the
left one like :mod:`autoq.cpu.dense` packs its activations (``a + shift`` in the ISA's
activation dtype), the right one into the ISA's weight blocks ``[batch, N/L, K/k, L, k]``
(VNNI: the int8 values as they are; AVX2: ``b - zb`` in int16, exact). With
``A' = a + sa`` and ``B' = b + sb`` the result is

``sum((a - za)(b - zb)) = sum(A'B') - zb' * sum(A') - za' * sum(B') + K * za' * zb'``

where ``za' = za + sa`` and ``zb' = zb + sb``: on AVX2 both are 0 (no correction), on VNNI
``za' = za + 128`` (int8 data) and ``zb' = zb``, and the row sums of ``A'`` / column sums of
``B'`` are computed in the kernel. Everything is int32 and exact.

>>> corrections(VNNI, "int8", 3, -5), corrections(AVX2, "int8", 3, -5)
((131, -5), (0, 0))
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq.cpu.epilogue import Epilogue, epilogue_compute
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.isa import AVX2, VNNI, Isa  # noqa: F401  (VNNI/AVX2: doctest)
from autoq.cpu.packing import round_up
from autoq.cpu.tiling import i64, int32, pick_tile, tensorize_accumulation

__all__ = ["batch_matmul_kernel", "corrections"]


def corrections(isa: Isa, a_dtype: str, za: int, zb: int) -> tuple[int, int]:
    """``(za', zb')``: the zero points of the packed operands (see the module docstring)."""
    sa = isa.shift(a_dtype, za)
    sb = -zb if isa.centered else 0
    return za + sa, zb + sb


def _pack_b(b, batch: int, k_dim: int, n: int, isa: Isa, zb: int):
    lanes, k = isa.lanes, isa.k
    kp, np_ = round_up(k_dim, k), isa.padded_channels(n)
    sb = -zb if isa.centered else 0

    def pack(t, o, c, oi, ci):
        kk, nn = c * k + ci, o * lanes + oi
        value = (int32(b[t, kk, nn]) + sb).astype(isa.weight_dtype)
        inside = tirx.all(kk < k_dim, nn < n)
        return tirx.if_then_else(inside, value, tirx.const(0, isa.weight_dtype))

    return te.compute((batch, np_ // lanes, kp // k, lanes, k), pack, name="autoq_pack_b")


def _compute(batch, m, k_dim, n, isa: Isa, a_dtype: str, za: int, zb: int, epi):
    lanes, k = isa.lanes, isa.k
    tile = pick_tile(m, isa.max_tile)
    mp, kp, np_ = round_up(m, tile), round_up(k_dim, k), isa.padded_channels(n)
    za2, zb2 = corrections(isa, a_dtype, za, zb)
    a = te.placeholder(i64(batch, m, k_dim), a_dtype, name="lhs")
    b = te.placeholder(i64(batch, k_dim, n), "int8", name="rhs")
    shift, sb = isa.shift(a_dtype, za), zb2 - zb

    def pack_a(t, i, j):
        value = (int32(a[t, i, j]) + shift).astype(isa.act_dtype)
        inside = tirx.all(i < m, j < k_dim)
        return tirx.if_then_else(inside, value, tirx.const(0, isa.act_dtype))

    pa = te.compute((batch, mp, kp), pack_a, name="autoq_pack")
    pb = _pack_b(b, batch, k_dim, n, isa, zb)
    rc, rk = te.reduce_axis((0, kp // k), "rc"), te.reduce_axis((0, k), "rk")
    acc = te.compute(
        (batch, mp, np_ // lanes, lanes),
        lambda t, i, o, oi: te.sum(
            int32(pa[t, i, rc * k + rk]) * int32(pb[t, o, rc, oi, rk]), axis=[rc, rk]
        ),
        name="autoq_acc",
    )
    inputs = [a, b]
    if za2 == 0 and zb2 == 0:
        value = lambda t, i, j: acc[t, i, j // lanes, j % lanes]  # noqa: E731
        out = epilogue_compute(i64(batch, m, n), value, 2, epi, inputs)
        return [*inputs, out], tile
    terms = []  # (coefficient, sum tensor, its index function)
    if zb2:
        r1 = te.reduce_axis((0, k_dim), "r1")
        rows = te.compute(
            (batch, m), lambda t, i: te.sum(int32(pa[t, i, r1]), axis=r1), name="autoq_rowsum"
        )
        terms.append((zb2, lambda t, i, j: rows[t, i]))
    if za2:
        r2 = te.reduce_axis((0, k_dim), "r2")
        cols = te.compute(
            (batch, n), lambda t, j: te.sum(int32(b[t, r2, j]) + sb, axis=r2), name="autoq_colsum"
        )
        terms.append((za2, lambda t, i, j: cols[t, j]))
    const = k_dim * za2 * zb2

    def corrected(t, i, j):
        value = acc[t, i, j // lanes, j % lanes]
        for coef, term in terms:
            value = value - coef * term(t, i, j)
        return value + const if const else value

    out = epilogue_compute(i64(batch, m, n), corrected, 2, epi, inputs)
    return [*inputs, out], tile


def batch_matmul_kernel(
    batch: int,
    m: int,
    k: int,
    n: int,
    isa: Isa,
    a_dtype: str,
    za: int,
    zb: int,
    epilogue: Epilogue | None = None,
):
    """The scheduled PrimFunc ``(lhs[batch, m, k], rhs[batch, k, n] int8[, table],
    out[batch, m, n])`` of ``(lhs - za) @ (rhs - zb)`` in int32 (or, with an ``epilogue``,
    requantized to int8/uint8); parallel over (batch, row tile, column block)."""
    tensors, tile = _compute(batch, m, k, n, isa, a_dtype, za, zb, epilogue)
    sch = Schedule(te.create_prim_func(tensors))
    block = sch.get_sblock("autoq_acc")
    t, i, o, oi, rc, rk = sch.get_loops(block)
    io, ii = sch.split(i, [None, tile])
    oo, ob = sch.split(o, [None, isa.channel_blocks(n)])
    sch.reorder(t, io, oo, rc, ii, ob, oi, rk)
    out = sch.get_sblock("autoq_out")
    corrected = corrections(isa, a_dtype, za, zb) != (0, 0)
    if not corrected:  # the output tile is copied out right after its accumulation
        sch.reverse_compute_at(out, oo)
    sch.parallel(sch.fuse(t, io, oo))
    sch.unroll(ii)
    sch.unroll(ob)
    tensorize_accumulation(sch, block, rc, oi, isa.intrinsic)
    za2, zb2 = corrections(isa, a_dtype, za, zb)
    names = ["autoq_pack", "autoq_pack_b"]
    if corrected:  # the sums must exist before any tile is corrected: own parallel loops
        names += ["autoq_rowsum"] * bool(zb2) + ["autoq_colsum"] * bool(za2) + ["autoq_out"]
    for name in names:
        loops = sch.get_loops(sch.get_sblock(name))
        sch.parallel(sch.fuse(loops[0], loops[1]))
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
