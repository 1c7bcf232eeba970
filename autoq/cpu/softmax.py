"""float32 softmax as one parallel PrimFunc (over the last axis: row-parallel; over another
axis: vectorized along the axes after it), with denormal probabilities flushed to zero.

TVM's legalized softmax is four separate loop nests, and its ``exp`` is inlined into both the
sum and the normalization (every exponential computed twice). Worse, a transformer's
attention mask (``-100`` after autoq's attention-mask rewrite, :mod:`autoq.ir.attention_mask`)
puts most probabilities of a padded sequence below the smallest normal float32
(``exp(-100)`` = 3.7e-44): x86 CPUs compute with such denormal numbers through microcode,
~100-500x slower (the ``probabilities @ V`` matmul of all-MiniLM-L6-v2: 55 ms on denormal
input, 0.1 ms on normal input, measured). Here a row is: max, ``e = exp(x - max)`` computed
once -- set to 0 where ``x - max < log(smallest normal)``, i.e. where it would be denormal --,
its sum in index order, ``e / sum``. Every other probability is the same float as TVM's own
softmax bit for bit (same operations in the same order, and :func:`autoq.cpu.expf.expf_expr`
gives libm's ``expf`` floats); flushed ones were below 1.2e-38.

Speed: the exponentials are vectorized (16 lanes) instead of one libm call each; rows go in
blocks of 16 whose sums run interleaved (16 independent serial sums: the index-order sum of
one row alone is a chain of dependent adds); the max is vectorized (any order gives the same
max). all-MiniLM-L6-v2's 12 x 128 x 128 attention softmax: 1.13 -> 0.27 ms (1 thread).
On AVX-512 the exponentials run 8 lanes at a time with the expf table read by two
``vpermi2q`` permutes (a computed-index load is scalarized by LLVM into a load and an insert
per lane): 0.29 -> 0.21 ms for the same softmax (Sapphire Rapids, 1 thread).
Over an inner axis (YOLOv8's box decoding: 16 bins on axis 1 of ``[1, 16, 4, 2100]``) each
lane of a vector is one position of the trailing axes, so the same per-position operations
(max, exponentials, the index-order sum, the division) run 16 positions at a time.

>>> import numpy as np
>>> LOG_SMALLEST_NORMAL == float(np.log(np.float32(np.finfo(np.float32).tiny)))
True
"""

from __future__ import annotations

import math

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from autoq.cpu.expf import EXPF_TABLE, PERMUTE_LANES, expf_expr
from autoq.cpu.injective import KERNEL_ATTR, memoized_kernel
from autoq.cpu.row_sums import ROW_BLOCK, row_sums
from autoq.qnn.tensor_exprs import dequantize_value

__all__ = [
    "LOG_SMALLEST_NORMAL",
    "MAX_INNER_BINS",
    "ROW_BLOCK",
    "dequantized",
    "inner_axis_covered",
    "softmax_kernel",
    "softmax_table",
]

LOG_SMALLEST_NORMAL = float(np.log(np.float32(np.finfo(np.float32).tiny)))
MAX_INNER_BINS = 256  # longest inner softmax axis (a vector of exponentials per bin: 16 KiB)
_LANES = 16
_LOWEST = float(np.finfo(np.float32).min)  # the init of TVM's max reduction


def softmax_table() -> np.ndarray:
    """The constant table operand of :func:`softmax_kernel` (:data:`autoq.cpu.expf.EXPF_TABLE`)."""
    return EXPF_TABLE


def _prob(d, table, lane=None):
    """exp(d) for ``d = x - max``, 0 where it would be denormal (the clamp keeps every
    computed exponential in expf's ordinary range); ``lane``: see
    :func:`autoq.cpu.expf.expf_expr`."""
    low = tirx.const(LOG_SMALLEST_NORMAL, "float32")
    e = expf_expr(tirx.max(d, low), table, lane)
    return tirx.Select(d >= low, e, tirx.const(0.0, "float32"))


def dequantized(q, scale: float, zero_point: int):
    """The float the ``qnn.dequantize`` legalization gives an int8 / uint8 code ``q``
    (:func:`autoq.qnn.tensor_exprs.dequantize_value`: ``float32(q - zero_point) * scale``)."""
    return dequantize_value(q, tirx.const(scale, "float32"), tirx.const(zero_point, "int32"))


@memoized_kernel
def softmax_kernel(
    shape: tuple[int, ...],
    axis: int = -1,
    permute: bool = False,
    dequantize: tuple[str, float, int] | None = None,
) -> tirx.PrimFunc:
    """The PrimFunc ``(data, table, out)`` of float32 softmax over ``axis`` of a static
    ``shape`` (``table``: :func:`softmax_table`, int64[32]). Over the last axis: parallel
    over blocks of ``ROW_BLOCK`` rows (all leading axes fused); over another axis (shapes
    :func:`inner_axis_covered` accepts): parallel over vectors of positions of the axes
    after it.
    ``out`` holds the exponentials until the division. ``permute`` (AVX-512 targets): the
    exponentials of a row (last-axis softmax) run 8 lanes at a time with the expf table read by permutes
    (:func:`autoq.cpu.expf.expf_expr`), the same floats.
    ``dequantize`` (last axis only): ``(dtype, scale, zero point)``, ``data`` holds int8 /
    uint8 codes and the softmax is of their :func:`dequantized` floats, written to a row of
    ``out`` first (stored, so that no ``x - max`` is contracted into an FMA with the
    dequantize's multiply: the same floats as a separate dequantize) and read from there:
    the float input tensor is never written."""
    shape = tuple(int(d) for d in shape)
    axis = axis % len(shape)
    if axis != len(shape) - 1:
        if dequantize is not None:
            raise ValueError("softmax_kernel: dequantize is for a last-axis softmax only")
        return _inner_axis_kernel(shape, axis)
    in_dtype = "float32" if dequantize is None else dequantize[0]
    n, rows = shape[-1], math.prod(shape[:-1])
    blocks, nv = -(-rows // ROW_BLOCK), n // _LANES * _LANES
    rb = ROW_BLOCK
    el = PERMUTE_LANES if permute else _LANES  # the exponentials' vector width
    ne = n // el * el

    def lane(v):
        return v if permute else None

    def read(x, out, row, k):  # the softmax's input float at [row, k]
        return x[row, k] if dequantize is None else out[row, k]

    def block_rows(out, first):  # the exponentials of row first + r at [r, k]
        return lambda r, k: out[first + r, k]

    @T.prim_func
    def softmax(
        x_in: T.Buffer(shape, in_dtype),
        table: T.Buffer((32,), "int64"),
        out_: T.Buffer(shape, "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        x = T.decl_buffer((rows, n), in_dtype, data=x_in.data)
        out = T.decl_buffer((rows, n), "float32", data=out_.data)
        for b in T.parallel(blocks):
            mx = T.decl_buffer((rb,), "float32")
            sums = T.decl_buffer((rb,), "float32")
            lanes = T.decl_buffer((_LANES,), "float32")
            count = T.min(rb, rows - b * rb)
            for r in range(count):
                row = b * rb + r
                for v in T.vectorized(_LANES):
                    lanes[v] = T.float32(_LOWEST)
                for ko in range(nv // _LANES):
                    for v in T.vectorized(_LANES):
                        if dequantize is not None:
                            out[row, ko * _LANES + v] = dequantized(
                                x[row, ko * _LANES + v], *dequantize[1:]
                            )
                        lanes[v] = T.max(lanes[v], read(x, out, row, ko * _LANES + v))
                mx[r] = T.float32(_LOWEST)
                for v in range(_LANES):
                    mx[r] = T.max(mx[r], lanes[v])
                for k in range(n - nv):
                    if dequantize is not None:
                        out[row, nv + k] = dequantized(x[row, nv + k], *dequantize[1:])
                    mx[r] = T.max(mx[r], read(x, out, row, nv + k))
                for ko in range(ne // el):
                    for v in T.vectorized(el):
                        out[row, ko * el + v] = _prob(
                            read(x, out, row, ko * el + v) - mx[r], table, lane(v)
                        )
                for k in range(n - ne):
                    out[row, ne + k] = _prob(read(x, out, row, ne + k) - mx[r], table)
            row_sums(sums, count, n, block_rows(out, b * rb))
            for r in range(count):
                for k in range(n):
                    out[b * rb + r, k] = out[b * rb + r, k] / sums[r]

    return softmax.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def inner_axis_covered(shape: tuple[int, ...], axis: int) -> bool:
    """Whether :func:`softmax_kernel` takes a softmax over ``axis`` of ``shape`` that is not
    the last axis: at least a vector of positions after it, at most ``MAX_INNER_BINS``
    along it (its exponentials of one vector of positions stay in a local buffer).

    >>> inner_axis_covered((1, 16, 4, 2100), 1), inner_axis_covered((1, 16, 4, 3), 1)
    (True, False)
    """
    axis = axis % len(shape)
    return math.prod(shape[axis + 1 :]) >= _LANES and shape[axis] <= MAX_INNER_BINS


def _inner_axis_kernel(shape: tuple[int, ...], axis: int) -> tirx.PrimFunc:
    """Softmax over ``axis`` of ``shape`` (not the last; :func:`inner_axis_covered`) as
    ``[outer, n, inner]``: each parallel task a vector of ``_LANES`` consecutive ``inner``
    positions of one ``outer`` index (the last vector ends at the last position, overlapping
    the one before it: those positions get the same floats twice), each lane its position's
    max, exponentials (in a local buffer), index-order sum and divisions."""
    outer, n, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])
    chunks, lanes = -(-inner // _LANES), _LANES

    @T.prim_func
    def softmax(
        x_in: T.Buffer(shape, "float32"),
        table: T.Buffer((32,), "int64"),
        out_: T.Buffer(shape, "float32"),
    ):
        T.func_attr({"tirx.noalias": True})
        x = T.decl_buffer((outer, n, inner), "float32", data=x_in.data)
        out = T.decl_buffer((outer, n, inner), "float32", data=out_.data)
        for t in T.parallel(outer * chunks):
            o = t // chunks
            p = T.min(t % chunks * lanes, inner - lanes)
            mx = T.decl_buffer((lanes,), "float32")
            sums = T.decl_buffer((lanes,), "float32")
            e = T.decl_buffer((n, lanes), "float32")
            for v in T.vectorized(lanes):
                mx[v] = T.float32(_LOWEST)
            for j in range(n):
                for v in T.vectorized(lanes):
                    mx[v] = T.max(mx[v], x[o, j, p + v])
            for j in range(n):
                for v in T.vectorized(lanes):
                    e[j, v] = _prob(x[o, j, p + v] - mx[v], table)
            for v in T.vectorized(lanes):
                sums[v] = T.float32(0)
            for j in range(n):
                for v in T.vectorized(lanes):
                    sums[v] = sums[v] + e[j, v]
            for j in range(n):
                for v in T.vectorized(lanes):
                    out[o, j, p + v] = e[j, v] / sums[v]

    return softmax.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
