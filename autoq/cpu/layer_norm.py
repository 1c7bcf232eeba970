"""float32 layer norm over the last axis as one row-parallel PrimFunc, the same floats as
TVM's generic lowering bit for bit.

TVM's legalized layer norm (topi's ``layer_norm``) is two passes over each row, each a chain
of dependent adds in index order (the add latency, not the throughput, bounds it): the sum
(``mean = sum / n``), then the sum of ``(x - mean) * (x - mean)`` (``var = var_sum / n``), and
``(x - mean) * rsqrt(var + eps) * gamma + beta``. Here the rows go in blocks of
``ROW_BLOCK`` whose sums run interleaved (``ROW_BLOCK`` independent index-order chains, the
same adds in the same order, :func:`autoq.cpu.row_sums.row_sums`), each row's
``rsqrt`` once, and the normalization of a row (still in cache) ``LANES`` at a time with
topi's own expression.

The chains of a whole block (``ROW_BLOCK`` = ``LANES`` rows of whole vectors) run as vector
adds: each ``LANES`` x ``LANES`` tile of the block is transposed in registers (four rounds
of two-vector shuffles) into a column-major copy of the block, whose vector ``k`` holds
column ``k`` of its rows; the sums add those vectors in index order, and the variance pass
reads the copy. Row-strided scalar reads had LLVM emit two ``vgatherqps`` per column on Zen
4. all-MiniLM-L6-v2's ``[1, 128, 384]`` layer norm (1 thread): 47.6 -> 13.9 us on Zen 4
(znver4), 18.7 -> 15.8 us for ``mcpu=haswell`` on the same machine, the same floats.

>>> f = layer_norm_kernel((2, 3, 40), 1e-5)
>>> [p.name for p in f.params]
['x_in', 'gamma', 'beta', 'out_']
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script import tirx as T

from autoq.cpu.injective import KERNEL_ATTR, memoized_kernel
from autoq.cpu.lane_transpose import LANES, TILE, transposed_tile
from autoq.cpu.row_sums import ROW_BLOCK, row_sums

__all__ = ["ROW_BLOCK", "layer_norm_kernel"]


@memoized_kernel
def layer_norm_kernel(shape: tuple[int, ...], epsilon: float) -> tirx.PrimFunc:
    """The PrimFunc ``(x_in, gamma[n], beta[n], out_)`` of float32 layer norm over the last axis
    (``n``) of a static ``shape``, parallel over blocks of ``ROW_BLOCK`` rows (all leading
    axes fused). A whole block of a row length that is a whole number of vectors is
    transposed ``LANES`` x ``LANES`` at a time
    (:func:`autoq.cpu.lane_transpose.transposed_tile`) into a column-major copy whose
    vectors (one column of the block's rows each) its sums add in index order: the row
    chains' adds, ``LANES`` at a time."""
    shape = tuple(int(d) for d in shape)
    n, rows = shape[-1], math.prod(shape[:-1])
    blocks, rb, nv = -(-rows // ROW_BLOCK), ROW_BLOCK, n // LANES * LANES
    extent, eps = tirx.const(float(n), "float32"), tirx.const(epsilon, "float32")
    transposed = n == nv and rb == LANES

    def lanes(buf, base):
        return buf[T.Ramp(base, 1, LANES)]

    def normalized(x, mean, rstd, g, b):
        return (x - mean) * rstd * g + b  # topi's expression, rsqrt(var + eps) as rstd

    def block_rows(x, first):  # row first + r at [r, k]
        return lambda r, k: x[first + r, k]

    def squared_deviations(x, first, mean):  # topi's variance addend of row first + r
        return lambda r, k: (x[first + r, k] - mean[r]) * (x[first + r, k] - mean[r])

    @T.prim_func
    def layer_norm(
        x_in: T.Buffer(shape, "float32"),
        gamma: T.Buffer((n,), "float32"),
        beta: T.Buffer((n,), "float32"),
        out_: T.Buffer(shape, "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        x = T.decl_buffer((rows, n), "float32", data=x_in.data)
        x_flat = T.decl_buffer((rows * n,), "float32", data=x_in.data)
        out = T.decl_buffer((rows, n), "float32", data=out_.data)
        for blk in T.parallel(blocks):
            mean = T.decl_buffer((rb,), "float32")
            var_sum = T.decl_buffer((rb,), "float32")
            count = T.min(rb, rows - blk * rb)
            if transposed and count == rb:
                cols = T.decl_buffer((n * LANES,), "float32")
                tile = T.decl_buffer((TILE,), "float32")
                mean[T.Ramp(0, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                for ko in range(n // LANES):
                    transposed_tile(tile, x_flat, (blk * rb) * n + ko * LANES, n)
                    for c in T.unroll(LANES):
                        cols[T.Ramp((ko * LANES + c) * LANES, 1, LANES)] = lanes(tile, c * LANES)
                        mean[T.Ramp(0, 1, LANES)] = lanes(mean, 0) + lanes(tile, c * LANES)
                mean[T.Ramp(0, 1, LANES)] = lanes(mean, 0) / T.Broadcast(extent, LANES)
                var_sum[T.Ramp(0, 1, LANES)] = T.Broadcast(T.float32(0), LANES)
                for k in range(n):
                    var_sum[T.Ramp(0, 1, LANES)] = lanes(var_sum, 0) + (
                        lanes(cols, k * LANES) - lanes(mean, 0)
                    ) * (lanes(cols, k * LANES) - lanes(mean, 0))
            else:
                row_sums(mean, count, n, block_rows(x, blk * rb))
                for r in range(count):
                    mean[r] = mean[r] / extent
                row_sums(var_sum, count, n, squared_deviations(x, blk * rb, mean))
            for r in range(count):
                row = blk * rb + r
                rstd = T.rsqrt(var_sum[r] / extent + eps)
                for ko in range(nv // LANES):
                    for v in T.vectorized(LANES):
                        out[row, ko * LANES + v] = normalized(
                            x[row, ko * LANES + v],
                            mean[r],
                            rstd,
                            gamma[ko * LANES + v],
                            beta[ko * LANES + v],
                        )
                for k in range(nv, n):
                    out[row, k] = normalized(x[row, k], mean[r], rstd, gamma[k], beta[k])

    return layer_norm.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
