"""int8 dense (``[M, K] x [N, K]^T``) on Intel AMX tiles (``tdpbusd``, uint8 x int8 -> int32).

The PrimFunc takes the int8/uint8 activations ``[M, K]``, the weights packed exactly as for
the VNNI dense kernel (:func:`autoq.cpu.packing.pack_dense_weight`, 16 lanes x 4, here with
N padded to 32 and K to 64) and the int32 compensation ``(zx + shift) * sum(w)``, and returns
the int32 ``(x - zx) @ w.T`` of ``qnn.dense``, like :mod:`autoq.cpu.dense`.

Inside: activations shifted to uint8 (``x + 128`` for int8 data, as on VNNI) into a
``[M/32*32, K/64*64]`` buffer; then each 32 x 32 output block is a 2 x 2 square of
accumulator tiles (tmm0-3, 16 rows x 16 int32); every 64-deep step loads two activation
tiles (tmm4-5: 16 rows x 64 uint8, row stride K) and two weight tiles (tmm6-7: 16 rows of
16 channels x 4 bytes, which is one ``[K/4, 16, 4]`` slab of the packed weights, row stride
64) and issues four ``tdpbusd``. The block is stored to a stack buffer and written out minus
the compensation; without an epilogue a complete block instead starts from ``-compensation``
(one 16-value row loaded into every accumulator row: row stride 0) and its tiles are stored
straight into the output (128 x 384 x 1152, MiniLM's query/key/value: 44 -> 40 us, 1 thread).
Parallel over (32-row block, group of 32-channel blocks); each task loads the tile
configuration (``ldtilecfg``, per thread state) first and releases it at the end.
The process must have been granted the tile state (:func:`autoq.cpu.amx.require_amx`).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from autoq.cpu.amx_tiles import (
    BLOCK,
    KSTEP,
    dot_block,
    intrin,
    load_config,
    move_block,
    store_block,
    task_groups,
    zero_block,
)
from autoq.cpu.epilogue import Epilogue, drop_table, table_shape, tail
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.packing import round_up

__all__ = ["amx_dense_kernel"]


def amx_dense_kernel(
    m: int, k_dim: int, n: int, data_dtype: str, shift: int, epilogue: Epilogue | None = None
) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(data[m, k], packed_weight[N/16, K/4, 16, 4], compensation[N][, table],
    out[m, n])`` (N, K: ``n``, ``k`` rounded up to 32 and 64); ``shift`` is added to the
    activations (128 for int8 data, 0 for uint8). With an ``epilogue`` the PrimFunc takes its
    table and stores the requantized int8/uint8 output."""
    out_dtype = "int32" if epilogue is None else epilogue.out_dtype
    finish = tail(epilogue)
    mp, kp, np_ = round_up(m, BLOCK), round_up(k_dim, KSTEP), round_up(n, BLOCK)
    row_blocks, groups = mp // BLOCK, task_groups(mp // BLOCK, np_ // BLOCK)
    per_group = np_ // BLOCK // groups
    steps = kp // KSTEP
    direct = epilogue is None  # int32 blocks: compensation as the accumulators' start

    @T.prim_func
    def amx_dense(
        x: T.Buffer((m, k_dim), data_dtype),
        w: T.Buffer((np_ // 16, kp // 4, 16, 4), "int8"),
        c: T.Buffer((np_,), "int32"),
        e: T.Buffer(table_shape(epilogue, n), "int32"),
        out: T.Buffer((m, n), out_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        a = T.decl_buffer((mp, kp), "uint8")
        for i in T.parallel(mp):
            for j in range(kp):
                a[i, j] = T.if_then_else(
                    i < m and j < k_dim,
                    T.Cast(
                        "uint8", T.Cast("int32", x[T.min(i, m - 1), T.min(j, k_dim - 1)]) + shift
                    ),
                    T.uint8(0),
                )
        minus_c = T.decl_buffer((np_,), "int32")
        for j in range(np_):
            minus_c[j] = -c[j]
        for task in T.parallel(row_blocks * groups):
            cfg = T.decl_buffer((64,), "uint8", scope="local")
            acc = T.decl_buffer((BLOCK, BLOCK), "int32", scope="local")
            load_config(cfg)
            r0 = task // groups * BLOCK
            for q in range(per_group):
                c0 = (task % groups * per_group + q) * BLOCK
                complete = r0 + BLOCK <= m and c0 + BLOCK <= n
                if direct and complete:  # -c in every row (row stride 0), stored in place
                    move_block("llvm.x86.tileloadd64", _corners(minus_c, None, c0), 0)
                else:
                    zero_block()
                for s in range(steps):
                    dot_block(
                        T.address_of(a[r0, s * KSTEP]),
                        T.address_of(a[r0 + 16, s * KSTEP]),
                        kp,
                        T.address_of(w[c0 // 16, s * 16, 0, 0]),
                        T.address_of(w[c0 // 16 + 1, s * 16, 0, 0]),
                    )
                if direct and complete:
                    move_block("llvm.x86.tilestored64", _corners(out, r0, c0), n * 4)
                else:
                    store_block(acc)
                    if complete:  # vector rows
                        for i in range(BLOCK):
                            for j in T.vectorized(BLOCK):
                                out[r0 + i, c0 + j] = finish(acc[i, j] - c[c0 + j], c0 + j, e)
                    else:
                        for i in range(T.min(BLOCK, m - r0)):
                            for j in range(T.min(BLOCK, n - c0)):
                                out[r0 + i, c0 + j] = finish(acc[i, j] - c[c0 + j], c0 + j, e)
            T.evaluate(intrin("llvm.x86.tilerelease"))

    func = drop_table(amx_dense, epilogue, 3)
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def _corners(buf, r0, c0):
    """Addresses of the 2 x 2 tiles of the block at ``(r0, c0)`` of ``buf`` (a 1-D ``buf``:
    ``r0`` None, the two column halves repeated for the bottom tiles)."""
    if r0 is None:
        return [T.address_of(buf[c0 + j]) for j in (0, 16, 0, 16)]
    return [T.address_of(buf[r0 + i, c0 + j]) for i, j in ((0, 0), (0, 16), (16, 0), (16, 16))]
