"""The AMX tile operations autoq's AMX kernels are written with (TVMScript pieces).

Every kernel uses the same register plan: one configuration of eight tiles of 16 rows x 64
bytes (palette 1), tmm0-3 the 2 x 2 int32 accumulators of a 32 x 32 output block, tmm4-5
two 16-row activation tiles (uint8), tmm6-7 two 16-channel weight tiles (int8, 16 rows of
16 channels x 4 consecutive reduction bytes: one ``[16, 16, 4]`` slab of the VNNI packing).
The tile instructions take tile numbers as immediates, so they are emitted as
``call_llvm_intrin`` of ``llvm.x86.{ldtilecfg, tilezero, tileloadd64, tdpbusd,
tilestored64, tilerelease}`` with constant tile numbers.
"""

from __future__ import annotations

from tvm.script import tirx as T

__all__ = [
    "BLOCK",
    "KSTEP",
    "dot_block",
    "intrin",
    "load_config",
    "load_rows",
    "move_block",
    "store_block",
    "task_groups",
    "task_run",
    "zero_block",
]

BLOCK = 32  # output rows / channels per block (2 x 2 tiles of 16)
KSTEP = 64  # reduction bytes per tile row
MIN_TASKS = 8  # parallel tasks wanted (the pool splits them statically)
RUN_TASKS = 32  # parallel tasks wanted when blocks run in sequence (2 threads: <= 3% imbalance)


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


def task_run(row_blocks: int, col_blocks: int) -> int:
    """How many consecutive blocks (32-row block, 32-channel block; channels fastest) one
    parallel task computes in sequence, so that a block's epilogue overlaps the next block's
    tile products: whole groups of :func:`task_groups`, as many as leave ``RUN_TASKS`` tasks.

    >>> task_run(458, 1), task_run(4, 12), task_run(98, 4), task_run(1, 1)
    (14, 6, 12, 1)
    """
    groups = task_groups(row_blocks, col_blocks)
    return col_blocks // groups * max(1, row_blocks * groups // RUN_TASKS)


def intrin(name: str, *args):
    """A void ``call_llvm_intrin``."""
    return T.call_llvm_intrin("void", name, *args)


@T.macro
def load_config(cfg, depth: int = KSTEP, low_rows: int = 16):
    """palette 1; 8 tiles of 16 rows x 64 bytes (colsb at bytes 16 + 2t, rows at 48 + t),
    except that a reduction ``depth`` under 64 bytes (a multiple of 4) narrows the row
    operands (tmm4-5) to ``depth`` bytes and shortens the column operands (tmm6-7) to
    ``depth / 4`` rows, and ``low_rows`` under 16 shortens the lower row operand (tmm5)
    and its accumulators (tmm2-3) to that many rows (a block whose rows 16 + low_rows ..
    31 are padding: their products are not computed)."""
    for b in range(64):
        cfg[b] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for t in range(8):
        cfg[16 + 2 * t] = T.uint8(KSTEP)
        cfg[48 + t] = T.uint8(16)
    for t in range(4, 6):
        cfg[16 + 2 * t] = T.uint8(depth)
        cfg[48 + t + 2] = T.uint8(depth // 4)
    cfg[50] = T.uint8(low_rows)
    cfg[51] = T.uint8(low_rows)
    cfg[53] = T.uint8(low_rows)
    T.evaluate(intrin("llvm.x86.ldtilecfg", T.address_of(cfg[0])))


def _tile(op: str, tmm: int, ptr, stride):
    return T.evaluate(intrin(op, T.uint8(tmm), ptr, T.int64(stride)))


@T.macro
def zero_block():
    T.evaluate(intrin("llvm.x86.tilezero", T.uint8(0)))
    T.evaluate(intrin("llvm.x86.tilezero", T.uint8(1)))
    T.evaluate(intrin("llvm.x86.tilezero", T.uint8(2)))
    T.evaluate(intrin("llvm.x86.tilezero", T.uint8(3)))


def dot_block(a0, a1, a_stride, b0, b1, b_stride=KSTEP, op="llvm.x86.tdpbusd"):
    """Load the row operands ``a0`` / ``a1`` (pointers, row stride ``a_stride`` bytes) and the
    column operands ``b0`` / ``b1`` (row stride ``b_stride``) and accumulate the 2 x 2 block
    ``C[2i + j] += A_i B_j`` (``tdpbusd``: uint8 rows x int8 columns; ``tdpbsud``: int8 rows
    x uint8 columns). Each load comes just before the first product that reads it (2-4% faster
    than the 4 loads first on PP-OCR det's 96 -> 24 3x3 conv, 1 thread)."""
    _tile("llvm.x86.tileloadd64", 4, a0, a_stride)
    _tile("llvm.x86.tileloadd64", 6, b0, b_stride)
    T.evaluate(intrin(op, T.uint8(0), T.uint8(4), T.uint8(6)))
    _tile("llvm.x86.tileloadd64", 7, b1, b_stride)
    T.evaluate(intrin(op, T.uint8(1), T.uint8(4), T.uint8(7)))
    _tile("llvm.x86.tileloadd64", 5, a1, a_stride)
    T.evaluate(intrin(op, T.uint8(2), T.uint8(5), T.uint8(6)))
    T.evaluate(intrin(op, T.uint8(3), T.uint8(5), T.uint8(7)))


def load_rows(c, c0):
    """The accumulators of rows ``c0 .. c0 + 31`` start from the 16 int32 of their rows of
    ``c`` (``[rows, 16]``: e.g. a conv's compensation, one value repeated along each row)."""
    move_block("llvm.x86.tileloadd64", [T.address_of(c[c0 + i, 0]) for i in (0, 0, 16, 16)], 64)


def move_block(op: str, ptrs, stride):
    """``tileloadd64`` / ``tilestored64`` of the 2 x 2 accumulators from / to ``ptrs``
    (tiles 0..3: top-left, top-right, bottom-left, bottom-right), row stride ``stride``."""
    for t, ptr in enumerate(ptrs):
        _tile(op, t, ptr, stride)


def store_block(acc):
    """The 2 x 2 accumulators into the int32 ``acc[32, 32]`` buffer."""
    ptrs = [T.address_of(acc[i, j]) for i, j in ((0, 0), (0, 16), (16, 0), (16, 16))]
    move_block("llvm.x86.tilestored64", ptrs, BLOCK * 4)
