"""int8 / uint8 NCHW max pooling as two separable passes (rows, then columns).

TVM's ``max_pool2d`` legalization reduces the ``kh x kw`` window of every output, whose
loads are strided by the pool's stride along the innermost axis: LLVM cannot vectorize
it. Here the window max is taken over the rows first (``rows[n, c, i, w] = max_kh x[n, c,
i * sh + kh - top, w]``, every padded column ``w``: contiguous, vectorized), then over the
columns at every column (``cols[.., w] = max_kw rows[.., w + kw]``, contiguous too), and the
output picks every ``sw``-th column. Padded positions (and the ones past the input that a
``ceil_mode`` window reaches) hold the dtype's minimum, like TVM's pool: the max is the
same, bit for bit (a max does not depend on the order it is taken in).

>>> f = max_pool2d_kernel((1, 2, 5, 5), "int8", (3, 3), (2, 2), (0, 0, 0, 0), (2, 2))
>>> [str(p.dtype) for p in f.params], [int(v) for v in f.params[1].shape]
(['int8', 'int8'], [1, 2, 2, 2])
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.s_tir import Schedule

from autoq import primitives as P
from autoq.cpu.injective import KERNEL_ATTR

__all__ = ["DTYPES", "max_pool2d_kernel"]

DTYPES = ("int8", "uint8")


def max_pool2d_kernel(shape, dtype: str, pool, strides, padding, out_hw) -> tirx.PrimFunc:
    """The PrimFunc ``(x [N, C, H, W], out [N, C, OH, OW])`` of a max pool with window
    ``pool`` (kh, kw), ``strides``, ``padding`` (top, left, bottom, right) and output size
    ``out_hw``, unit dilation."""
    if dtype not in DTYPES:
        raise ValueError(f"max_pool2d_kernel: dtype must be int8 or uint8, got {dtype!r}")
    n, c, h, w = (int(v) for v in shape)
    (kh, kw), (sh, sw), (top, left) = pool, strides, padding[:2]
    oh, ow = out_hw
    wp = (ow - 1) * sw + kw  # the padded columns the windows read
    low = tirx.const(P.qrange(dtype)[0], dtype)
    x = te.placeholder((n, c, h, w), dtype, name="x")

    def at(b, ch, r, col):
        inside = tirx.all(r >= 0, r < h, col >= 0, col < w)
        rc, cc = te.max(te.min(r, h - 1), 0), te.max(te.min(col, w - 1), 0)
        return tirx.Select(inside, x[b, ch, rc, cc], low)

    def row_max(b, ch, i, col):
        v = at(b, ch, i * sh - top, col - left)
        for k in range(1, kh):
            v = te.max(v, at(b, ch, i * sh + k - top, col - left))
        return v

    rows = te.compute((n, c, oh, wp), row_max, name="rows")

    def col_max(b, ch, i, col):
        v = rows[b, ch, i, col]
        for k in range(1, kw):
            v = te.max(v, rows[b, ch, i, col + k])
        return v

    cols = te.compute((n, c, oh, wp - kw + 1), col_max, name="cols")
    out = te.compute((n, c, oh, ow), lambda b, ch, i, j: cols[b, ch, i, j * sw], name="pool")
    sch = Schedule(te.create_prim_func([x, out]))
    for name in ("rows", "cols", "pool"):  # each pass parallel over the channels
        loops = sch.get_loops(sch.get_sblock(name))
        sch.parallel(sch.fuse(loops[0], loops[1]))
    # opaque to FuseOps, which would fuse a producer's buffer into it inconsistently
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
