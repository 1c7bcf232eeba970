"""Per-token ``qnn.dynamic_quantize`` (float32 ``[rows, K]`` -> int8/uint8, scale, zero point
per row) as one row-parallel kernel.

The generic legalization is three loop nests: the row minima and maxima (scalar reductions),
the qparams, the quantize. Here each thread takes whole rows and, per row, reduces ``K`` in
``LANES`` vector lanes (min and max are exact, so any order gives the same values), folds
the lanes, computes the scale and zero point with the legalization's own expressions
(:func:`autoq.qnn.dynamic_quantize.runtime_scale` / ``runtime_zero_point``) and quantizes the
row while it is in cache (:func:`autoq.qnn.tensor_exprs.quantize_value`: a true division, so
the outputs are those of the generic lowering bit for bit), ``LANES`` at a time (LLVM's own
vectorization of that loop took 8: 128 x 1536 70 -> 64 us, 1 thread).

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
from autoq.qnn.tensor_exprs import quantize_value

__all__ = ["LANES", "dynamic_quantize_kernel"]

LANES = 16  # float32 lanes of an AVX-512 register (two AVX2 registers)


@memoized_kernel
def dynamic_quantize_kernel(
    rows: int, k: int, out_dtype: str, qrange: tuple[int, int], symmetric: bool
) -> tvm.tirx.PrimFunc:
    """The PrimFunc ``(x[rows, k] float32, q[rows, k] out_dtype, scale[rows, 1] float32,
    zero_point[rows, 1] int32)``; ``qrange``: the qparams' ``(qmin, qmax)`` (narrow or
    reduced ranges; the quantized values always clip to ``out_dtype``'s full range)."""
    qmin, qmax = qrange
    lo_q, hi_q = P.qrange(out_dtype)
    blocks, rest = divmod(k, LANES)
    big, small = T.max_value("float32"), T.min_value("float32")  # te.min / te.max identities

    @T.prim_func(check_well_formed=False)  # the root block: see below
    def dynamic_quantize(
        x: T.Buffer((rows, k), "float32"),
        q: T.Buffer((rows, k), out_dtype),
        scale: T.Buffer((rows, 1), "float32"),
        zero_point: T.Buffer((rows, 1), "int32"),
    ):
        T.func_attr({"tirx.noalias": True})
        with T.sblock("root"):  # a root block, as Relax passes expect of one-input kernels
            for r in T.parallel(rows):
                lo = T.decl_buffer((LANES,), "float32", scope="local")
                hi = T.decl_buffer((LANES,), "float32", scope="local")
                ext = T.decl_buffer((2,), "float32", scope="local")
                for j in T.vectorized(LANES):
                    lo[j] = big
                    hi[j] = small
                for b in range(blocks):
                    for j in T.vectorized(LANES):
                        lo[j] = T.min(lo[j], x[r, b * LANES + j])
                        hi[j] = T.max(hi[j], x[r, b * LANES + j])
                for j in range(rest):
                    lo[j] = T.min(lo[j], x[r, blocks * LANES + j])
                    hi[j] = T.max(hi[j], x[r, blocks * LANES + j])
                ext[0] = lo[0]
                ext[1] = hi[0]
                for j in range(1, LANES):
                    ext[0] = T.min(ext[0], lo[j])
                    ext[1] = T.max(ext[1], hi[j])
                scale[r, 0] = runtime_scale(ext[0], ext[1], qmin, qmax, symmetric)
                zero_point[r, 0] = runtime_zero_point(ext[0], scale[r, 0], qmin, qmax, symmetric)
                for b in range(blocks):
                    for j in T.vectorized(LANES):
                        q[r, b * LANES + j] = T.Cast(
                            out_dtype,
                            quantize_value(
                                x[r, b * LANES + j], scale[r, 0], zero_point[r, 0], lo_q, hi_q
                            ),
                        )
                for j in range(blocks * LANES, k):
                    q[r, j] = T.Cast(
                        out_dtype,
                        quantize_value(x[r, j], scale[r, 0], zero_point[r, 0], lo_q, hi_q),
                    )

    return dynamic_quantize.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
