"""int8 dense (``[M, K] x [N, K]^T``) as a packed, tensorized PrimFunc with a fixed schedule.

Inputs: int8/uint8 activations ``[M, K]``, weights packed by
:func:`autoq.cpu.packing.pack_dense_weight`, and (when the activations are shifted) the int32
compensation; output: the int32 ``(x - zx) @ w.T`` that ``qnn.dense`` returns. Rows are
padded to a multiple of the register tile, K to the ISA's ``k``; parallel over (row tile,
output-channel block).
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq.cpu.epilogue import epilogue_compute
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.isa import Isa
from autoq.cpu.packing import round_up
from autoq.cpu.tiling import i64, int32, pick_tile, tensorize_accumulation

__all__ = ["dense_kernel"]


def _compute(
    m: int, k_dim: int, n: int, isa: Isa, data_dtype: str, shift: int, pad_value: int, epi
):
    lanes, k = isa.lanes, isa.k
    tile = pick_tile(m, isa.max_tile, isa.row_slack)
    mp, kp, np_ = round_up(m, tile), round_up(k_dim, k), isa.padded_channels(n)
    x = te.placeholder(i64(m, k_dim), data_dtype, name="data")
    w = te.placeholder((np_ // lanes, kp // k, lanes, k), isa.weight_dtype, name="weight")

    def pack(i, j):
        value = (int32(x[i, j]) + shift).astype(isa.act_dtype)
        inside = tirx.all(i < m, j < k_dim)
        return tirx.if_then_else(inside, value, tirx.const(pad_value, isa.act_dtype))

    packed = te.compute((mp, kp), pack, name="autoq_pack")
    rc, rk = te.reduce_axis((0, kp // k), "rc"), te.reduce_axis((0, k), "rk")
    acc = te.compute(
        (mp, np_ // lanes, lanes),
        lambda i, o, oi: te.sum(
            int32(packed[i, rc * k + rk]) * int32(w[o, rc, oi, rk]), axis=[rc, rk]
        ),
        name="autoq_acc",
    )
    c = te.placeholder((np_,), "int32", name="compensation") if pad_value else None
    inputs = [x, w] if c is None else [x, w, c]

    def value(i, j):
        v = acc[i, j // lanes, j % lanes]
        return v if c is None else v - c[j]

    out = epilogue_compute(i64(m, n), value, 1, epi, inputs)
    return [*inputs, out], tile


def dense_kernel(m: int, k: int, n: int, isa: Isa, data_dtype: str, zero_point: int, epilogue=None):
    """The scheduled PrimFunc ``(data[m, k], packed_weight[, compensation][, table],
    out[m, n])``; the compensation input exists when ``zero_point + isa.shift(data_dtype,
    zero_point)`` != 0, the table with an :class:`autoq.cpu.epilogue.Epilogue` (then ``out``
    is its int8/uint8 requantized output)."""
    shift = isa.shift(data_dtype, zero_point)
    tensors, tile = _compute(m, k, n, isa, data_dtype, shift, zero_point + shift, epilogue)
    sch = Schedule(te.create_prim_func(tensors))
    block = sch.get_sblock("autoq_acc")
    i, o, oi, rc, rk = sch.get_loops(block)
    io, ii = sch.split(i, [None, tile])
    oo, ob = sch.split(o, [None, isa.channel_blocks(n)])
    sch.reorder(io, oo, rc, ii, ob, oi, rk)
    sch.reverse_compute_at(sch.get_consumers(block)[0], oo)
    sch.parallel(sch.fuse(io, oo))
    sch.unroll(ii)
    sch.unroll(ob)
    tensorize_accumulation(sch, block, rc, oi, isa.intrinsic)
    pack = sch.get_sblock("autoq_pack")
    sch.parallel(sch.get_loops(pack)[0])
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})  # see conv2d
