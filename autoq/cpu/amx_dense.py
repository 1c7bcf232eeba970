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
the compensation. Parallel over (32-row block, group of 32-channel blocks); each task loads
the tile configuration (``ldtilecfg``, per thread state) first and releases it at the end.
The process must have been granted the tile state (:func:`autoq.cpu.amx.require_amx`).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .injective import KERNEL_ATTR
from .packing import round_up

__all__ = ["BLOCK", "KSTEP", "amx_dense_kernel", "task_groups"]

BLOCK = 32  # output rows / channels per task step (2 x 2 tiles of 16)
KSTEP = 64  # reduction bytes per tile row
MIN_TASKS = 8  # parallel tasks wanted (the pool splits them statically)


def task_groups(row_blocks: int, col_blocks: int) -> int:
    """Into how many groups the ``col_blocks`` 32-channel blocks of a 32-row block are split
    (each group is one parallel task): the fewest that give ``MIN_TASKS`` tasks in all.

    >>> task_groups(4, 12), task_groups(1, 12), task_groups(8, 48), task_groups(1, 1)
    (2, 12, 1, 1)
    """
    for groups in range(1, col_blocks + 1):
        if col_blocks % groups == 0 and row_blocks * groups >= MIN_TASKS:
            return groups
    return col_blocks


def _intrin(name: str, *args):
    return T.call_llvm_intrin("void", name, *args)


@T.macro
def _load_config(cfg):
    """palette 1; 8 tiles of 16 rows x 64 bytes (colsb at bytes 16 + 2t, rows at 48 + t)."""
    for b in range(64):
        cfg[b] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for t in range(8):
        cfg[16 + 2 * t] = T.uint8(KSTEP)
        cfg[48 + t] = T.uint8(16)
    T.evaluate(_intrin("llvm.x86.ldtilecfg", T.address_of(cfg[0])))


def _tile(op: str, tmm: int, ptr, stride: int):
    return T.evaluate(_intrin(op, T.uint8(tmm), ptr, T.int64(stride)))


def _dot(c: int, a: int, b: int):
    return T.evaluate(_intrin("llvm.x86.tdpbusd", T.uint8(c), T.uint8(a), T.uint8(b)))


def _zero(tmm: int):
    return T.evaluate(_intrin("llvm.x86.tilezero", T.uint8(tmm)))


def amx_dense_kernel(m: int, k_dim: int, n: int, data_dtype: str, shift: int) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(data[m, k], packed_weight[N/16, K/4, 16, 4], compensation[N],
    out[m, n])`` (N, K: ``n``, ``k`` rounded up to 32 and 64); ``shift`` is added to the
    activations (128 for int8 data, 0 for uint8)."""
    mp, kp, np_ = round_up(m, BLOCK), round_up(k_dim, KSTEP), round_up(n, BLOCK)
    row_blocks, groups = mp // BLOCK, task_groups(mp // BLOCK, np_ // BLOCK)
    per_group = np_ // BLOCK // groups
    steps = kp // KSTEP

    @T.prim_func
    def amx_dense(
        x: T.Buffer((m, k_dim), data_dtype),
        w: T.Buffer((np_ // 16, kp // 4, 16, 4), "int8"),
        c: T.Buffer((np_,), "int32"),
        out: T.Buffer((m, n), "int32"),
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
        for task in T.parallel(row_blocks * groups):
            cfg = T.decl_buffer((64,), "uint8", scope="local")
            acc = T.decl_buffer((BLOCK, BLOCK), "int32", scope="local")
            _load_config(cfg)
            r0 = task // groups * BLOCK
            for q in range(per_group):
                c0 = (task % groups * per_group + q) * BLOCK
                _zero(0)
                _zero(1)
                _zero(2)
                _zero(3)
                for s in range(steps):
                    _tile("llvm.x86.tileloadd64", 4, T.address_of(a[r0, s * KSTEP]), kp)
                    _tile("llvm.x86.tileloadd64", 5, T.address_of(a[r0 + 16, s * KSTEP]), kp)
                    _tile("llvm.x86.tileloadd64", 6, T.address_of(w[c0 // 16, s * 16, 0, 0]), 64)
                    _tile(
                        "llvm.x86.tileloadd64", 7, T.address_of(w[c0 // 16 + 1, s * 16, 0, 0]), 64
                    )
                    _dot(0, 4, 6)
                    _dot(1, 4, 7)
                    _dot(2, 5, 6)
                    _dot(3, 5, 7)
                _tile("llvm.x86.tilestored64", 0, T.address_of(acc[0, 0]), BLOCK * 4)
                _tile("llvm.x86.tilestored64", 1, T.address_of(acc[0, 16]), BLOCK * 4)
                _tile("llvm.x86.tilestored64", 2, T.address_of(acc[16, 0]), BLOCK * 4)
                _tile("llvm.x86.tilestored64", 3, T.address_of(acc[16, 16]), BLOCK * 4)
                for i in range(T.min(BLOCK, m - r0)):
                    for j in range(T.min(BLOCK, n - c0)):
                        out[r0 + i, c0 + j] = acc[i, j] - c[c0 + j]
            T.evaluate(_intrin("llvm.x86.tilerelease"))

    return amx_dense.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
