"""Per-token ``qnn.dynamic_quantize`` (float32 ``[rows, K]`` -> int8/uint8, scale, zero point
per row) as one row-parallel kernel.

The generic legalization is three loop nests: the row minima and maxima (scalar reductions),
the qparams, the quantize. Here each parallel task takes ``ROWS`` whole rows (its local
buffers are allocated once per task: one allocation per row cost about a third of the
kernel) and, per row, reduces ``K`` in ``CHAINS`` independent vectors of ``LANES`` lanes
(min and max are exact, so any order gives the same values), folds them, computes the scale
and zero point with the legalization's own expressions
(:func:`autoq.qnn.dynamic_quantize.runtime_scale` / ``runtime_zero_point``) and quantizes the
row while it is in cache (:func:`autoq.qnn.tensor_exprs.quantize_value`), ``LANES`` at a
time. The quotient ``x / s`` is the division's, so the outputs are those of the generic
lowering bit for bit: a true division, or, on the targets whose kernels divide by a
reciprocal (:attr:`autoq.cpu.isa.Isa.reciprocal`) and for a scale in
:data:`autoq.primitives.RECIPROCAL_SCALE_RANGE`, ``x * RN(1 / s)`` with two FMA corrections
(:func:`autoq.qnn.tensor_exprs.divide_by_reciprocal`). By Markstein's theorem
(:func:`autoq.primitives.reciprocal_division_steps`) one correction of a faithful product
gives the quotient and the first correction makes any product faithful, for every ``x``
that does not underflow; a row's values are at most 256 scales apart, and values below a
quarter of a scale round to 0 whatever the last bits of their quotient. all-MiniLM-L6-v2's
quantizes (1 thread, CPU min, load 5.8): 128 x 384 26.2 -> 19.4 us (tasks of 8 rows and 4
chains) -> 17.6 us (the reciprocal), 128 x 1536 67.6 -> 53.0 -> 45.9 us.

>>> f = dynamic_quantize_kernel(3, 20, "int8", (-128, 127), False)
>>> [p.name for p in f.params]
['x', 'q', 'scale', 'zero_point']
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from autoq import primitives as P
from autoq.cpu.injective import KERNEL_ATTR, memoized_kernel
from autoq.qnn.dynamic_quantize import runtime_scale, runtime_zero_point
from autoq.qnn.tensor_exprs import divide_by_reciprocal, quantize_value

__all__ = ["LANES", "dynamic_quantize_kernel"]

LANES = 16  # float32 lanes of an AVX-512 register (two AVX2 registers)
ROWS = 8  # rows per parallel task (its local buffers are allocated once per task)
CHAINS = 4  # independent min / max vectors per row (one chain waits on each vminps' latency)


def _quotient(v, s, inv):
    """``v / s``: divided, or (``inv`` = RN(1 / s)) the reciprocal product with two FMA
    corrections, the same value (the module docstring)."""
    return v / s if inv is None else divide_by_reciprocal(v, s, inv, 2)


def _quantized(x, s, z, inv, lo_q, hi_q, out_dtype):
    """The code of ``x``: ``x / s`` (:func:`_quotient`) rounded, ``z`` added, clipped."""
    return T.Cast(out_dtype, quantize_value(x, s, z, lo_q, hi_q, quotient=_quotient(x, s, inv)))


@T.macro
def _quantize_row(x, q, r, s, z, inv, blocks, k, out_dtype, lo_q, hi_q):
    """Row ``r`` of ``q`` (:func:`_quantized`), ``LANES`` at a time and a scalar tail (no
    let-bound element in the vector loop: TVM 0.27 vectorizes one wrongly)."""
    for b in range(blocks):
        for j in T.vectorized(LANES):
            q[r, b * LANES + j] = _quantized(x[r, b * LANES + j], s, z, inv, lo_q, hi_q, out_dtype)
    for j in range(blocks * LANES, k):
        q[r, j] = _quantized(x[r, j], s, z, inv, lo_q, hi_q, out_dtype)


@memoized_kernel
def dynamic_quantize_kernel(
    rows: int,
    k: int,
    out_dtype: str,
    qrange: tuple[int, int],
    symmetric: bool,
    reciprocal: bool = False,
) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(x[rows, k] float32, q[rows, k] out_dtype, scale[rows, 1] float32,
    zero_point[rows, 1] int32)``; ``qrange``: the qparams' ``(qmin, qmax)`` (narrow or
    reduced ranges; the quantized values always clip to ``out_dtype``'s full range).
    ``reciprocal``: a row whose scale lies in ``RECIPROCAL_SCALE_RANGE`` divides as ``x *
    RN(1 / s)`` with two FMA corrections (the quotient of the division, bit for bit: see
    the module docstring); other rows divide."""
    qmin, qmax = qrange
    lo_q, hi_q = P.qrange(out_dtype)
    blocks, rest = divmod(k, LANES)
    groups, span = blocks // CHAINS, CHAINS * LANES
    row_blocks = -(-rows // ROWS)
    big, small = T.max_value("float32"), T.min_value("float32")  # te.min / te.max identities
    lo_s, hi_s = (T.float32(v) for v in P.RECIPROCAL_SCALE_RANGE)

    @T.prim_func(check_well_formed=False)  # the root block: see below
    def dynamic_quantize(
        x: T.Buffer((rows, k), "float32"),
        q: T.Buffer((rows, k), out_dtype),
        scale: T.Buffer((rows, 1), "float32"),
        zero_point: T.Buffer((rows, 1), "int32"),
    ):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):  # a root block, as Relax passes expect of one-input kernels
            for blk in T.parallel(row_blocks):
                lo = T.decl_buffer((CHAINS * LANES,), "float32", scope="local")
                hi = T.decl_buffer((CHAINS * LANES,), "float32", scope="local")
                ext = T.decl_buffer((2,), "float32", scope="local")
                for r in range(blk * ROWS, T.min(blk * ROWS + ROWS, rows)):
                    for j in T.vectorized(CHAINS * LANES):
                        lo[j] = big
                        hi[j] = small
                    for g in range(groups):
                        for c in T.unroll(CHAINS):
                            for j in T.vectorized(LANES):
                                lo[c * LANES + j] = T.min(
                                    lo[c * LANES + j], x[r, g * span + c * LANES + j]
                                )
                                hi[c * LANES + j] = T.max(
                                    hi[c * LANES + j], x[r, g * span + c * LANES + j]
                                )
                    for b in range(groups * CHAINS, blocks):
                        for j in T.vectorized(LANES):
                            lo[j] = T.min(lo[j], x[r, b * LANES + j])
                            hi[j] = T.max(hi[j], x[r, b * LANES + j])
                    for j in range(rest):
                        lo[j] = T.min(lo[j], x[r, blocks * LANES + j])
                        hi[j] = T.max(hi[j], x[r, blocks * LANES + j])
                    for c in T.unroll(CHAINS - 1):
                        for j in T.vectorized(LANES):
                            lo[j] = T.min(lo[j], lo[c * LANES + LANES + j])
                            hi[j] = T.max(hi[j], hi[c * LANES + LANES + j])
                    ext[0] = lo[0]
                    ext[1] = hi[0]
                    for j in range(1, LANES):
                        ext[0] = T.min(ext[0], lo[j])
                        ext[1] = T.max(ext[1], hi[j])
                    s = T.float32(runtime_scale(ext[0], ext[1], qmin, qmax, symmetric))
                    z = T.int32(runtime_zero_point(ext[0], s, qmin, qmax, symmetric))
                    scale[r, 0] = s
                    zero_point[r, 0] = z
                    if reciprocal and lo_s <= s and s <= hi_s:
                        inv = T.float32(T.float32(1) / s)
                        _quantize_row(x, q, r, s, z, inv, blocks, k, out_dtype, lo_q, hi_q)
                    else:
                        _quantize_row(x, q, r, s, z, None, blocks, k, out_dtype, lo_q, hi_q)

    return dynamic_quantize.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
