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

from autoq import primitives as P
from autoq.cpu.expf import EXPF_TABLE, PERMUTE_LANES, expf_expr
from autoq.cpu.injective import KERNEL_ATTR, memoized_kernel
from autoq.cpu.row_sums import ROW_BLOCK, row_sums
from autoq.qnn.tensor_exprs import dequantize_value, divide_by_reciprocal, quantize_value

__all__ = [
    "LOG_SMALLEST_NORMAL",
    "MAX_INNER_BINS",
    "ROW_BLOCK",
    "dequantized",
    "inner_axis_covered",
    "quantizes",
    "softmax_kernel",
    "softmax_table",
]

LOG_SMALLEST_NORMAL = float(np.log(np.float32(np.finfo(np.float32).tiny)))
_MAX_ROW = 1 << 24  # longest row quantized with reciprocals (:func:`quantizes`)
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
    quantize: tuple[str, float, int] | None = None,
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
    the float input tensor is never written.
    ``quantize`` (last axis only; :func:`quantizes`): ``(dtype, scale, zero point)``, ``out``
    holds the per-tensor ``qnn.quantize`` codes of the probabilities (the exponentials in a
    local block of rows), both divisions by a reciprocal (:func:`_codes`), the same codes."""
    shape = tuple(int(d) for d in shape)
    axis = axis % len(shape)
    if axis != len(shape) - 1:
        if dequantize is not None or quantize is not None:
            raise ValueError("softmax_kernel: (de)quantize is for a last-axis softmax only")
        return _inner_axis_kernel(shape, axis)
    if quantize is not None and not quantizes(shape[-1], quantize[1]):
        raise ValueError(f"softmax_kernel: no exact reciprocal quantize for {shape}, {quantize}")
    in_dtype = "float32" if dequantize is None else dequantize[0]
    out_dtype = "float32" if quantize is None else quantize[0]
    n, rows = shape[-1], math.prod(shape[:-1])
    blocks, nv = -(-rows // ROW_BLOCK), n // _LANES * _LANES
    rb = ROW_BLOCK
    el = PERMUTE_LANES if permute else _LANES  # the exponentials' vector width
    ne = n // el * el

    def lane(v):
        return v if permute else None

    # the floats of row ``b * rb + r`` (dequantized input, exponentials) are row ``at(b, r)``
    # of ``out``: the output's own, or with ``quantize`` a local block of rows
    def at(b, r):
        return r if quantize is not None else b * rb + r

    def read(x, out, b, r, k):  # the softmax's input float at [b * rb + r, k]
        return x[b * rb + r, k] if dequantize is None else out[at(b, r), k]

    def block_rows(out, first):  # the exponentials of row first + r at [r, k]
        return lambda r, k: out[first + r, k]

    @T.prim_func
    def softmax(
        x_in: T.Buffer(shape, in_dtype),
        table: T.Buffer((32,), "int64"),
        out_: T.Buffer(shape, out_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        x = T.decl_buffer((rows, n), in_dtype, data=x_in.data)
        codes = T.decl_buffer((rows, n), out_dtype, data=out_.data)
        for b in T.parallel(blocks):
            mx = T.decl_buffer((rb,), "float32")
            sums = T.decl_buffer((rb,), "float32")
            lanes = T.decl_buffer((_LANES,), "float32")
            out = T.decl_buffer(
                (rows, n) if quantize is None else (rb, n), "float32", data=_data(out_, quantize)
            )
            count = T.min(rb, rows - b * rb)
            for r in range(count):
                row = at(b, r)
                for v in T.vectorized(_LANES):
                    lanes[v] = T.float32(_LOWEST)
                for ko in range(nv // _LANES):
                    for v in T.vectorized(_LANES):
                        if dequantize is not None:
                            out[row, ko * _LANES + v] = dequantized(
                                x[b * rb + r, ko * _LANES + v], *dequantize[1:]
                            )
                        lanes[v] = T.max(lanes[v], read(x, out, b, r, ko * _LANES + v))
                mx[r] = T.float32(_LOWEST)
                for v in range(_LANES):
                    mx[r] = T.max(mx[r], lanes[v])
                for k in range(n - nv):
                    if dequantize is not None:
                        out[row, nv + k] = dequantized(x[b * rb + r, nv + k], *dequantize[1:])
                    mx[r] = T.max(mx[r], read(x, out, b, r, nv + k))
                for ko in range(ne // el):
                    for v in T.vectorized(el):
                        out[row, ko * el + v] = _prob(
                            read(x, out, b, r, ko * el + v) - mx[r], table, lane(v)
                        )
                for k in range(n - ne):
                    out[row, ne + k] = _prob(read(x, out, b, r, ne + k) - mx[r], table)
            row_sums(sums, count, n, block_rows(out, at(b, 0)))
            if quantize is None:
                for r in range(count):
                    for k in range(n):
                        out[b * rb + r, k] = out[b * rb + r, k] / sums[r]
            else:
                for r in range(count):
                    mx[r] = T.float32(1) / sums[r]  # the row's reciprocal, in the max's place
                    for ko in range(nv // _LANES):
                        for v in T.vectorized(_LANES):
                            codes[b * rb + r, ko * _LANES + v] = _codes(
                                out[r, ko * _LANES + v], sums[r], mx[r], quantize
                            )
                    for k in range(n - nv):
                        codes[b * rb + r, nv + k] = _codes(out[r, nv + k], sums[r], mx[r], quantize)

    return softmax.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def _data(out, quantize):
    """The data of the float rows: ``out``'s own, or None (a local block: ``quantize``)."""
    return out.data if quantize is None else None


def quantizes(n: int, scale: float) -> bool:
    """Whether :func:`softmax_kernel` quantizes the probabilities of rows of ``n`` by ``scale``
    exactly with reciprocals (:func:`_codes`): ``n <= 2**24`` and the scale in
    :data:`autoq.primitives.RECIPROCAL_SCALE_RANGE`.

    >>> quantizes(128, 1 / 255), quantizes(128, 1e-30)
    (True, False)
    """
    lo, hi = P.RECIPROCAL_SCALE_RANGE
    return n <= _MAX_ROW and lo <= float(np.float32(scale)) <= hi


def _codes(e, total, inv, quantize):
    """The ``qnn.quantize`` code of the probability ``e / total`` (``inv`` = RN(1 / total)):
    the quotient ``p`` as ``e * inv`` with two FMA corrections, then ``p / scale`` as ``p *
    RN(1 / scale)`` with two more.

    Exact: a code depends on ``p`` only where ``p / scale >= 1/4`` (below, both the exact and
    the computed quotient round to the zero point), so where ``e >= p >= scale / 4 >=
    2**-62`` (``total`` >= 1: the row's maximum has exponential 1); there ``e``, ``total`` (in
    ``[1, 2**24]``) and ``p`` (``>= 2**-86``) are far from underflow and Markstein's theorem
    (:func:`autoq.primitives.reciprocal_division_steps`: the first correction makes the
    product faithful, the second gives the quotient) holds for both divisions. Smaller ``e``
    (0 included) give ``p`` below ``2**-62`` (relative error ``2**-20`` at most, plus a few
    subnormal ulps) and a quotient below 1/2: the zero point, as the exact values give."""
    dtype, scale, zero = quantize
    s = tirx.const(float(np.float32(scale)), "float32")
    r = tirx.const(float(np.float32(1) / np.float32(scale)), "float32")
    p = divide_by_reciprocal(e, total, inv, 2)
    qmin, qmax = P.qrange(dtype)
    z = tirx.const(int(zero), "int32")
    return tirx.Cast(
        dtype, quantize_value(p, s, z, qmin, qmax, quotient=divide_by_reciprocal(p, s, r, 2))
    )


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
