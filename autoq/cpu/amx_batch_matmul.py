"""int8 matmul of two activations (``qnn.matmul``: attention's ``q @ k^T`` and ``p @ v``) on
Intel AMX tiles, batched over the leading axes (the heads); the AMX counterpart of
:mod:`autoq.cpu.batch_matmul`, with its operands and results.

Per head (in parallel tasks of consecutive heads, :func:`head_tasks`): the right operand ``b[K, N]`` is interleaved into the
column tiles' layout ``[N/16, K/4, 16, 4]`` (four rows' 16-byte pieces shuffled into one
64-byte vector, :func:`interleave_indices`); the left operand ``a[M, K]`` is loaded into the
row tiles straight from the input (row stride ``K``): the raw codes, ``tdpbssd`` for int8
(``tdpbusd`` for uint8) data, so the zero points come in only through the correction of
:func:`autoq.cpu.batch_matmul.start` with shift 0,
``sum((a - za)(b - zb)) = sum(ab) - zb * sum(a) - za * sum(b) + K za zb``.
The row sums of ``a`` are tile products with a row of ones (row stride 0), the column sums
of ``b`` vector adds over its rows. Each 32 x 32 output block is the 2 x 2 accumulator
tiles of :mod:`autoq.cpu.amx_tiles` over ``K / depth`` steps (``depth`` = 64 bytes, or ``K``
itself when ``K < 64``: tiles narrowed by the configuration, no zero padding), stored to
the stack and written out plus the correction (requantized by the epilogue, if any). Every
term is exact int32: the same results as the VNNI kernel, bit for bit.

Shapes: ``M`` and ``N`` multiples of 32, ``K`` a multiple of 4 up to 64 or of 64
(:func:`amx_batch_matmul_applies`; MiniLM's ``12 x 128 x 32 x 128`` and ``12 x 128 x 128 x 32``).
The process must have been granted the tile state (:func:`autoq.cpu.amx.require_amx`).

>>> amx_batch_matmul_applies(128, 32, 128), amx_batch_matmul_applies(128, 96, 32)
(True, False)
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from autoq.cpu import amx_tiles as tiles
from autoq.cpu.amx_tiles import BLOCK, KSTEP, intrin
from autoq.cpu.batch_matmul import accumulator_bound, start
from autoq.cpu.epilogue import Epilogue, drop_table, table_shape, tail
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.isa import VNNI

__all__ = [
    "MIN_TASKS",
    "amx_batch_matmul_applies",
    "amx_batch_matmul_kernel",
    "head_tasks",
    "interleave_indices",
]

MIN_TASKS = 4  # parallel tasks wanted (each loads the tile configuration once)
_COLUMNS = 16  # channels of a column tile (16 int32 accumulator lanes)


def amx_batch_matmul_applies(m: int, k: int, n: int) -> bool:
    """Whether :func:`amx_batch_matmul_kernel` covers ``[M, K] x [K, N]`` per head."""
    whole = m % BLOCK == 0 and n % BLOCK == 0 and k % 4 == 0
    return whole and 0 < k and (k <= KSTEP or k % KSTEP == 0)


def head_tasks(batch: int) -> int:
    """Into how many parallel tasks (runs of consecutive heads) the batch is split: the
    fewest, at least ``MIN_TASKS`` (or ``batch``), that divide it evenly. Each task loads the
    tile configuration and takes its buffers once (MiniLM's ``q @ k^T``, 12 heads, 1
    thread: 12 tasks 66.8 us, 4 tasks 61.7 us).

    >>> head_tasks(12), head_tasks(6), head_tasks(2), head_tasks(7)
    (4, 6, 2, 7)
    """
    want = min(batch, MIN_TASKS)
    return next(d for d in range(want, batch + 1) if batch % d == 0)


def interleave_indices() -> list[int]:
    """The shuffle indices (into four concatenated 16-byte rows ``k, k+1, k+2, k+3`` of
    ``b``) of one 64-byte row of a column tile: channel ``c``'s four bytes, then channel
    ``c + 1``'s...

    >>> interleave_indices()[:9]
    [0, 16, 32, 48, 1, 17, 33, 49, 2]
    """
    return [r * _COLUMNS + c for c in range(_COLUMNS) for r in range(4)]


def _interleaved(b, t, k0, c0):
    """The 64 bytes of ``b[t, k0:k0 + 4, c0:c0 + 16]`` in the column tiles' order."""
    rows = [b[t, k0 + r, T.Ramp(c0, 1, _COLUMNS)] for r in range(4)]
    return tirx.Shuffle(rows, [tirx.IntImm("int32", i) for i in interleave_indices()])


def _row_sum_step(rows_ptr, stride: int, ones, op: str):
    """tmm0 += the 16 rows at ``rows_ptr`` (row stride ``stride``) times a tile of ones
    (``ones``' 64 bytes in every row): every column of tmm0 gets the rows' sums."""
    T.evaluate(intrin("llvm.x86.tileloadd64", T.uint8(4), rows_ptr, T.int64(stride)))
    T.evaluate(intrin("llvm.x86.tileloadd64", T.uint8(6), T.address_of(ones[0]), T.int64(0)))
    T.evaluate(intrin(op, T.uint8(0), T.uint8(4), T.uint8(6)))


def amx_batch_matmul_kernel(batch: int, m: int, k_dim: int, n: int, a_dtype: str,
                            epilogue: Epilogue | None = None,
                            zero_points: tuple[int, int] | None = None) -> tvm.tirx.PrimFunc:  # fmt: skip
    """The PrimFunc of :func:`autoq.cpu.batch_matmul.batch_matmul_kernel` (the same
    parameters, results and ``zero_points`` bound) on AMX tiles, parallel over the batch;
    for shapes :func:`amx_batch_matmul_applies` accepts."""
    if not amx_batch_matmul_applies(m, k_dim, n):
        raise ValueError(f"amx_batch_matmul_kernel: no AMX blocks for {m} x {k_dim} x {n}")
    out_dtype = "int32" if epilogue is None else epilogue.out_dtype
    bound = None if zero_points is None else accumulator_bound(k_dim, a_dtype, *zero_points)
    depth = min(k_dim, KSTEP)
    steps, quads = k_dim // depth, k_dim // 4
    op = "llvm.x86.tdpbssd" if a_dtype == "int8" else "llvm.x86.tdpbusd"
    tasks = head_tasks(batch)
    per_task = batch // tasks

    finish = tail(epilogue, bound)

    @T.prim_func
    def amx_batch_matmul(
        a: T.Buffer((batch, m, k_dim), a_dtype),
        b: T.Buffer((batch, k_dim, n), "int8"),
        zp: T.Buffer((2,), "int32"),
        e: T.Buffer(table_shape(epilogue, n), "int32"),
        out: T.Buffer((batch, m, n), out_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        for task in T.parallel(tasks):
            cfg = T.decl_buffer((64,), "uint8", scope="local")
            ones = T.decl_buffer((KSTEP,), "int8", scope="local")
            packed = T.decl_buffer((n * k_dim,), "int8", scope="local")
            sums = T.decl_buffer((_COLUMNS, _COLUMNS), "int32", scope="local")
            rows = T.decl_buffer((m,), "int32", scope="local")
            cols = T.decl_buffer((n,), "int32", scope="local")
            acc = T.decl_buffer((BLOCK, BLOCK), "int32", scope="local")
            tiles.load_config(cfg, depth)
            for j in T.vectorized(KSTEP):
                ones[j] = T.int8(1)
            for t in range(task * per_task, task * per_task + per_task):
                for o, q in T.grid(n // _COLUMNS, quads):
                    packed[T.Ramp((o * quads + q) * KSTEP, 1, KSTEP)] = _interleaved(
                        b, t, q * 4, o * _COLUMNS
                    )
                for j in T.vectorized(n):
                    cols[j] = 0
                for kk in range(k_dim):
                    for j in T.vectorized(n):
                        cols[j] = cols[j] + T.Cast("int32", b[t, kk, j])
                for r0 in range(m // _COLUMNS):  # row sums: a @ ones, in every column
                    T.evaluate(intrin("llvm.x86.tilezero", T.uint8(0)))
                    for s in range(steps):
                        _row_sum_step(T.address_of(a[t, r0 * _COLUMNS, s * depth]), k_dim, ones, op)
                    # (the whole buffer's access pointer: TVM would shrink a buffer whose
                    # accesses are one address and column 0 to that column)
                    whole = T.tvm_access_ptr(
                        T.type_annotation("int32"), sums.data, 0, _COLUMNS * _COLUMNS, 2
                    )
                    tiles.move_block("llvm.x86.tilestored64", [whole], _COLUMNS * 4)
                    for i in range(_COLUMNS):
                        rows[r0 * _COLUMNS + i] = sums[i, 0]
                for r0, c0 in T.grid(m // BLOCK, n // BLOCK):
                    tiles.zero_block()
                    for s in range(steps):
                        tiles.dot_block(
                            T.address_of(a[t, r0 * BLOCK, s * depth]),
                            T.address_of(a[t, r0 * BLOCK + 16, s * depth]),
                            k_dim,
                            T.address_of(packed[(c0 * 2 * quads + s * depth // 4) * KSTEP]),
                            T.address_of(packed[((c0 * 2 + 1) * quads + s * depth // 4) * KSTEP]),
                            op=op,
                        )
                    tiles.store_block(acc)
                    for i in range(BLOCK):
                        for j in T.vectorized(BLOCK):
                            out[t, r0 * BLOCK + i, c0 * BLOCK + j] = finish(
                                acc[i, j]
                                + start(
                                    VNNI,
                                    k_dim,
                                    zp[0],
                                    zp[1],
                                    0,
                                    rows[r0 * BLOCK + i],
                                    cols[c0 * BLOCK + j],
                                ),
                                c0 * BLOCK + j,
                                e,
                            )
            T.evaluate(intrin("llvm.x86.tilerelease"))

    func = drop_table(amx_batch_matmul, epilogue, 3)
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
