"""Layer-input second moments for data-aware weight rounding: ``H = 2 X^T X / n``.

GPTQ (:mod:`autoq.accuracy.gptq`) needs,
for each quantized layer, the matrix ``H`` of its *inputs* such that the layer's output
error on the calibration data is ``||X dW^T||^2 = tr(dW H dW^T) * n / 2`` for a weight
error ``dW`` (Frantar et al. 2022, "GPTQ", eq. 1; the factor 2 is theirs). Pure numpy.

Layouts follow the fp32 graph:

* dense: ``W`` is ``(out, in)``, inputs ``(..., in)``: one ``(in, in)`` matrix;
* conv2d (NCHW data, OIHW kernel, ``groups`` any, depthwise included): the convolution is
  a matrix product over *patches* (im2col, :func:`conv_unfold`): group ``g`` computes
  ``patches[g] @ W[g].T`` with ``W[g]`` the group's rows flattened to ``(O/G, C/G*kh*kw)``
  (:func:`flatten_conv_weight`). Each group has its own ``(K, K)`` matrix,
  ``K = C/G * kh * kw``: a depthwise 3x3 layer with C channels has C matrices of 9x9.

All results have a leading group axis ``G`` (1 for dense and ordinary convolutions).
Accumulation is in float64 and streams: :class:`Hessian` takes one batch at a time and
never keeps the activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CodeHessian",
    "ConvGeometry",
    "Hessian",
    "add_gram",
    "column_squares",
    "conv_unfold",
    "even_rows",
    "flatten_conv_weight",
    "output_error",
    "unflatten_conv_weight",
]


def _pair(v, name: str) -> tuple[int, int]:
    t = (int(v), int(v)) if np.ndim(v) == 0 else tuple(int(x) for x in v)
    if len(t) != 2 or min(t) < 1:
        raise ValueError(f"{name} must be one positive int or two, got {v!r}")
    return t  # type: ignore[return-value]


def _padding(p) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) from an int, (h, w) or 4 values (Relax's order)."""
    t = (int(p),) * 4 if np.ndim(p) == 0 else tuple(int(x) for x in p)
    if len(t) == 2:
        t = (t[0], t[1], t[0], t[1])
    if len(t) != 4 or min(t) < 0:
        raise ValueError(f"padding must be 1, 2 or 4 non-negative ints, got {p!r}")
    return t  # type: ignore[return-value]


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution's shape parameters (NCHW data, OIHW kernel), as in ``R.nn.conv2d``.

    ``padding`` is ``(top, left, bottom, right)`` (an int or ``(h, w)`` is expanded).
    """

    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", _pair(self.kernel, "kernel"))
        object.__setattr__(self, "strides", _pair(self.strides, "strides"))
        object.__setattr__(self, "dilation", _pair(self.dilation, "dilation"))
        object.__setattr__(self, "padding", _padding(self.padding))
        if int(self.groups) < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups!r}")
        object.__setattr__(self, "groups", int(self.groups))


def even_rows(total: int, max_rows: int | None) -> np.ndarray | None:
    """``max_rows`` evenly spaced indices into ``total`` rows (None: keep all).

    >>> even_rows(10, 4).tolist(), even_rows(3, 4)
    ([0, 3, 6, 9], None)
    """
    if max_rows is None or total <= max_rows:
        return None
    return np.linspace(0, total - 1, int(max_rows)).round().astype(np.int64)


def conv_unfold(x: np.ndarray, geom: ConvGeometry, max_rows: int | None = None) -> np.ndarray:
    """im2col: the patches that each output position of the convolution reads.

    ``x`` is NCHW. Returns ``(G, N*OH*OW, C/G*kh*kw)``: row ``n*OH*OW + oh*OW + ow`` of group
    ``g`` holds, in the order ``(c, i, j)`` of an OIHW kernel, the (zero-padded) inputs that
    output pixel ``(n, oh, ow)`` multiplies with the kernel of the group's channels; so
    ``conv2d(x, W)[n, g*O/G + o, oh, ow] == (patches[g] @ flatten_conv_weight(W, G)[g].T)``.

    A 1x1 input, 2x2 kernel, padding 1 on every side: the four patches are the four
    positions of the single pixel inside the padded 3x3 image.

    >>> geom = ConvGeometry(kernel=2, padding=1)
    >>> conv_unfold(np.array([[[[5.0]]]]), geom)[0]
    array([[0., 0., 0., 5.],
           [0., 0., 5., 0.],
           [0., 5., 0., 0.],
           [5., 0., 0., 0.]])

    Stride 2 and dilation 2 on a 1x1x4x4 image with a 1x2 kernel (columns 0 and 2 read):

    >>> x = np.arange(16.0).reshape(1, 1, 4, 4)
    >>> conv_unfold(x, ConvGeometry(kernel=(1, 2), strides=2, dilation=2))[0]
    array([[ 0.,  2.],
           [ 8., 10.]])

    ``max_rows``: only the rows :func:`even_rows` picks are gathered (the cost is then
    proportional to them, not to the image).
    """
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"conv_unfold expects NCHW data, got shape {x.shape}")
    n, c, _, _ = x.shape
    g = geom.groups
    if c % g:
        raise ValueError(f"{c} input channels do not split into {g} groups")
    (kh, kw), (sh, sw), (dh, dw) = geom.kernel, geom.strides, geom.dilation
    top, left, bottom, right = geom.padding
    oh, ow = _output_size(x.shape, geom)
    keep = even_rows(n * oh * ow, max_rows)
    if keep is not None:  # gather the kept output pixels only, one fancy index per tap
        return _gather_rows(x, geom, np.unravel_index(keep, (n, oh, ow)))
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    # one strided copy per kernel tap (fast), laid out as columns (G, K, N*OH*OW)
    cols = np.empty((n, c, kh, kw, oh, ow), x.dtype)
    for i in range(kh):
        for j in range(kw):
            r, q = i * dh, j * dw
            cols[:, :, i, j] = xp[
                :, :, r : r + sh * (oh - 1) + 1 : sh, q : q + sw * (ow - 1) + 1 : sw
            ]
    cols = cols.reshape(n, g, (c // g) * kh * kw, oh * ow).transpose(1, 2, 0, 3)
    return cols.reshape(g, (c // g) * kh * kw, n * oh * ow).transpose(0, 2, 1)


def _output_size(shape: tuple, geom: ConvGeometry) -> tuple[int, int]:
    """(OH, OW) of the convolution of an NCHW input of ``shape``."""
    (kh, kw), (sh, sw), (dh, dw) = geom.kernel, geom.strides, geom.dilation
    top, left, bottom, right = geom.padding
    oh = (shape[2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(
            f"kernel {geom.kernel} (dilation {geom.dilation}) is larger than the input"
        )
    return oh, ow


def _gather_rows(x: np.ndarray, geom: ConvGeometry, pixels: tuple) -> np.ndarray:
    """The patches of the output ``pixels`` (``(n, oh, ow)`` index arrays) as ``(G, rows,
    K)``, read from ``x`` itself (taps in the padding are 0: no padded copy of ``x``)."""
    _, c, h, w = x.shape
    g = geom.groups
    (kh, kw), (sh, sw), (dh, dw) = geom.kernel, geom.strides, geom.dilation
    top, left, _, _ = geom.padding
    nn, yy, xx = pixels
    sub = np.zeros((c, kh, kw, nn.size), x.dtype)
    for i in range(kh):
        ys = i * dh + sh * yy - top
        for j in range(kw):
            xs = j * dw + sw * xx - left
            inside = (ys >= 0) & (ys < h) & (xs >= 0) & (xs < w)
            if inside.all():
                sub[:, i, j] = x[nn, :, ys, xs].T
            elif inside.any():
                sub[:, i, j, inside] = x[nn[inside], :, ys[inside], xs[inside]].T
    return sub.reshape(g, (c // g) * kh * kw, nn.size).transpose(0, 2, 1)


def flatten_conv_weight(w: np.ndarray, groups: int = 1) -> np.ndarray:
    """OIHW kernel -> ``(G, O/G, C/G*kh*kw)``, the matrices :func:`conv_unfold` multiplies.

    >>> flatten_conv_weight(np.zeros((6, 2, 3, 3)), groups=3).shape
    (3, 2, 18)
    """
    w = np.asarray(w)
    if w.ndim != 4 or w.shape[0] % groups:
        raise ValueError(f"expected an OIHW kernel with O divisible by {groups}, got {w.shape}")
    return w.reshape(groups, w.shape[0] // groups, -1)


def unflatten_conv_weight(wf: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Inverse of :func:`flatten_conv_weight` (back to the OIHW ``shape``)."""
    return np.asarray(wf).reshape(tuple(shape))


class Hessian:
    """Streaming ``H = 2/n * sum X^T X`` of one layer's inputs, per group.

    ``Hessian.dense(in_features)`` for ``x @ W.T`` layers (any leading axes, the last is
    ``in``); ``Hessian.conv2d(geom, in_channels)`` for convolutions (NCHW batches, unfolded
    with :func:`conv_unfold`). ``n`` counts rows: tokens, or output pixels times batch.

    >>> h = Hessian.dense(2)
    >>> h.update(np.array([[1.0, 0.0], [1.0, 2.0]]))
    >>> h.matrix()[0]          # 2/2 * [[1+1, 0+2], [0+2, 0+4]]
    array([[2., 2.],
           [2., 4.]])
    >>> h.rows, h.mean()[0].tolist()
    (2, [1.0, 1.0])
    """

    def __init__(
        self,
        groups: int,
        size: int,
        geom: ConvGeometry | None = None,
        max_rows: int | None = None,
    ):
        self.geom = geom
        self.max_rows = max_rows
        self.shape = (int(groups), int(size))
        self.sum = np.zeros((groups, size, size), np.float64)
        self.row_sum = np.zeros((groups, size), np.float64)
        self.rows = 0

    @classmethod
    def dense(cls, in_features: int, max_rows: int | None = None, **kw) -> Hessian:
        return cls(1, int(in_features), None, max_rows, **kw)

    @classmethod
    def conv2d(
        cls, geom: ConvGeometry, in_channels: int, max_rows: int | None = None, **kw
    ) -> Hessian:
        if in_channels % geom.groups:
            raise ValueError(f"{in_channels} input channels do not split into {geom.groups} groups")
        size = in_channels // geom.groups * geom.kernel[0] * geom.kernel[1]
        return cls(geom.groups, size, geom, max_rows, **kw)

    def rows_of(self, x: np.ndarray, dtype=np.float64) -> np.ndarray:
        """The ``(G, rows, K)`` matrix whose product with the weight is the layer output."""
        x = np.asarray(x, dtype)
        if self.geom is not None:
            return conv_unfold(x, self.geom, self.max_rows)
        if x.shape[-1] != self.shape[1]:
            raise ValueError(f"dense input has {x.shape[-1]} features, expected {self.shape[1]}")
        rows = x.reshape(1, -1, x.shape[-1])
        keep = even_rows(rows.shape[1], self.max_rows)
        return rows if keep is None else rows[:, keep]

    def rows_size(self, shape: tuple) -> int:
        """How many values :meth:`rows_of` gives for an input of ``shape`` (without
        computing them)."""
        if self.geom is not None:
            oh, ow = _output_size(shape, self.geom)
            total = shape[0] * oh * ow
        else:
            total = int(np.prod(shape[:-1], dtype=np.int64))
        rows = total if self.max_rows is None else min(total, int(self.max_rows))
        return rows * self.shape[0] * self.shape[1]

    def update(self, x: np.ndarray) -> None:
        """Add one batch. With ``max_rows``, a batch with more rows (output pixels) keeps
        ``max_rows`` of them, evenly spaced: it bounds the cost of early, high-resolution
        layers (12k pixels per image for K = 9) at a small loss of precision in H."""
        cols = self.rows_of(x).transpose(0, 2, 1)  # (G, K, rows), contiguous for conv
        self.sum += np.matmul(cols, cols.transpose(0, 2, 1))
        self.row_sum += cols.sum(axis=2)
        self.rows += cols.shape[2]

    def merge(self, other: Hessian) -> None:
        """Add ``other``'s rows (another shard of the same layer's inputs): the result is
        that of one Hessian fed both shards, up to float64 summation order."""
        if other.sum.shape != self.sum.shape:
            raise ValueError(f"cannot merge Hessians of shapes {other.sum.shape}, {self.sum.shape}")
        self.sum += other.sum
        self.row_sum += other.row_sum
        self.rows += other.rows

    def matrix(self) -> np.ndarray:
        """``(G, K, K)`` float64; raises before any update."""
        self._check()
        return 2.0 * self.sum / self.rows

    def mean(self) -> np.ndarray:
        """``(G, K)``: the mean input row (patch), so that ``W_flat @ mean`` is the mean
        output per channel without bias (what bias correction needs)."""
        self._check()
        return self.row_sum / self.rows

    def _check(self) -> None:
        if self.rows == 0:
            raise ValueError("no data: call update() with the layer's inputs first")


#: float32 / float64 hold every integer up to these exactly
_EXACT_INT = {np.dtype(np.float32): 2**24, np.dtype(np.float64): 2**53}
#: buffered code values of one :class:`CodeHessian` before its product is taken anyway
FLUSH = 1 << 23


def _exact_dtype(m: int) -> np.dtype:
    """float32 when products of codes up to ``m`` and their sums over a chunk stay exact."""
    return np.dtype(np.float32 if m * m <= _EXACT_INT[np.dtype(np.float32)] else np.float64)


def _exact_step(m: int) -> int:
    """Rows per exact product whatever the codes up to ``m`` (int8 codes: 1024 rows in
    float32): the bound used when one batch alone exceeds :func:`column_squares`' test."""
    return max(1, _EXACT_INT[_exact_dtype(m)] // max(m * m, 1))


def column_squares(cols: np.ndarray, m: int) -> np.ndarray:
    """``(G, K)`` bound on the sum of squares of each column of integer-valued ``cols``
    ``(G, K, rows)``: the exact sums for float32 blocks (codes up to 4096: every square is
    below 2**24, their float64 sums are exact), ``m**2 * rows`` for float64 blocks.

    A product ``C^T C`` of rows whose columns all have such a sum ``<= 2**24`` is exact in
    float32 in any order of addition: every partial sum of entry ``(i, j)`` is an integer of
    magnitude at most ``sum_r |c_ri c_rj| <= sqrt(D_i D_j) <= max(D_i, D_j)`` (Cauchy-Schwarz).

    >>> column_squares(np.array([[[3.0, 4.0], [0.0, 1.0]]], np.float32), 4).tolist()
    [[25.0, 1.0]]
    """
    if cols.dtype == np.float32:
        return np.einsum("gkr,gkr->gk", cols, cols, dtype=np.float64)
    return np.full(cols.shape[:2], float(m * m) * cols.shape[2])


#: the product of a group at least :data:`GRAM_MIN` wide is taken in block rows of this
#: many columns, the upper triangle only (mirrored)
GRAM_BLOCK = 256
#: below this width numpy's own product of ``C`` with its transpose (BLAS ``syrk``, which
#: numpy calls for ``C @ C.T``) is faster; from it up the block rows are (measured CPU
#: time, one OpenBLAS thread, Zen 4: 2304 wide 0.18 s full vs 0.21 s blocks, 3072 wide 0.43
#: vs 0.32 s, 4608 wide 0.90 vs 0.47 s)
GRAM_MIN = 3072


def add_gram(cols: np.ndarray, out: np.ndarray) -> None:
    """``out += C C^T`` for each group of ``cols`` ``(G, K, rows)``, integer-valued
    float32/float64 whose products are exact (see :func:`column_squares`), into the int64
    ``out`` ``(G, K, K)``.

    Every entry of an exact product is the same integer whatever the order of addition, so
    a group at least :data:`GRAM_MIN` wide is computed in block rows of its upper triangle
    (one matrix product per :data:`GRAM_BLOCK` rows, the diagonal block included) and
    mirrored: the bits of the full product, in about 0.6 of its multiply-adds at matrix
    product speed (OpenBLAS's symmetric rank-k update, ``syrk``, which numpy uses for the
    full ``C @ C.T``, slows down at such widths).

    >>> out = np.zeros((1, 2, 2), np.int64)
    >>> add_gram(np.array([[[1.0, 1.0], [0.0, 2.0]]], np.float32), out)
    >>> out.tolist()
    [[[2, 2], [2, 4]]]
    """
    g, k, _ = cols.shape
    if k < max(GRAM_MIN, 2 * GRAM_BLOCK):
        out += np.matmul(cols, cols.transpose(0, 2, 1)).astype(np.int64)
        return
    for i in range(g):
        c, o = np.ascontiguousarray(cols[i]), out[i]
        for a in range(0, k, GRAM_BLOCK):
            b = min(a + GRAM_BLOCK, k)
            p = c[a:b] @ c[a:].T  # rows a:b, columns a: of C C^T
            np.add(o[a:b, a:], p, out=o[a:b, a:], dtype=np.int64, casting="unsafe")
            np.add(o[b:, a:b], p[:, b - a :].T, out=o[b:, a:b], dtype=np.int64, casting="unsafe")


class CodeHessian(Hessian):
    """:class:`Hessian` of a layer whose input is quantized per tensor, ``x = scale * c``,
    fed the integer *codes* ``c = q - zero_point`` and summed exactly.

    ``sum`` and ``row_sum`` are int64. Each batch's ``C^T C`` is a BLAS product of integers
    whose partial sums stay below 2**24 (float32; codes up to 4096 in magnitude) or 2**53
    (float64): rows are grouped into products whose columns' sums of squares stay within
    that bound (:func:`column_squares`), so each product is exact whatever order the BLAS
    adds in, and int64 sums do not depend on the grouping or the order of the batches. Shards of the data merged in any order give the same
    ``H`` bit for bit as one pass (what distributed weight tuning needs, see
    :mod:`autoq.distributed`); ``matrix()`` and ``mean()`` apply ``scale`` once at the end
    (``x = scale * c`` in exact arithmetic, where the graph's dequantize rounds to float32:
    a relative difference below 2**-24). int64 holds the sums of 1.4e14 rows of int8 codes
    (2e9 of int16). The arrays are allocated at the first product (an empty one is cheap
    to send to a worker).

    Codes [1, 0] and [1, 2] with scale 0.5 (the :class:`Hessian` example's inputs halved):

    >>> h = CodeHessian.dense(2, scale=0.5)
    >>> h.update(np.array([[1, 0], [1, 2]]))
    >>> h.flush()  # buffered rows summed (matrix() and mean() flush too)
    >>> h.sum[0].tolist(), h.matrix()[0].tolist()
    ([[2, 2], [2, 4]], [[0.5, 0.5], [0.5, 1.0]])
    >>> h.rows, h.mean()[0].tolist()
    (2, [0.5, 0.5])
    """

    def __init__(self, *args, scale: float = 1.0, products: bool = True, **kw):
        """:class:`Hessian`'s arguments, ``scale`` (of the codes, per tensor) and
        ``products``: False sums only the rows and their count (:meth:`mean`, ``rows``),
        not ``C^T C`` (:meth:`matrix` then raises): for a layer that will not use it."""
        super().__init__(*args, **kw)
        self.products = products
        self.sum = self.row_sum = None  # allocated at the first product
        self._pending: list[np.ndarray] = []  # (G, K, rows) code blocks not summed yet
        self._pending_sq: np.ndarray | None = None  # their columns' sums of squares
        self._pending_size = 0  # their code values in all
        self.scale = float(np.float32(scale))
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")

    def update(self, codes: np.ndarray) -> None:
        """Add one batch of integer codes (any integer dtype). The rows are buffered while
        every column's sum of squares over the buffer stays exact (:func:`column_squares`,
        at most 2**24 in float32), then summed in one product (see :meth:`flush`): one
        product per sample would be a rank-49 update of a 1152x1152 matrix for a 1x1 conv
        at 7x7, memory bound (measured 3-7x slower on EfficientNet-Lite0's 1x1
        convolutions); activations use a small part of their range on most rows, so the
        data's own bound allows products of thousands of rows where the worst case
        (``2**24 / max_code**2``) allows 258 for codes up to 255. When the kept rows hold
        fewer values than the batch (a large image's patches), they are gathered from the
        integers first and only they are bounded and converted (the same integers)."""
        c = np.asarray(codes)
        if c.dtype.kind not in "iu":
            raise ValueError(f"CodeHessian takes integer codes (q - zero_point), got {c.dtype}")
        if self.rows_size(c.shape) < c.size:  # the kept rows first: bound and convert those
            rows = self.rows_of(c, c.dtype)
            m = self._bound(rows)
            self._buffer(rows.astype(_exact_dtype(m)).transpose(0, 2, 1), m)
            return
        m = self._bound(c)
        self._buffer(self.rows_of(c, _exact_dtype(m)).transpose(0, 2, 1), m)

    def update_rows(self, cols: np.ndarray, bound: int | None = None) -> None:
        """Add one batch given as its rows already (:meth:`rows_of` of the codes, transposed
        to ``(G, K, rows)``), float32 or float64 integers: e.g. the kept patches of a float
        input gathered first and quantized by :func:`autoq.accuracy.weight_tuning.quantize_offset`
        (the same integers as quantizing the whole input, for a fraction of the values).
        ``bound``: a bound on the codes' magnitude when they are integers by construction
        (``quantize_offset``'s clip range): the integer check and the data's bound (three
        passes over the rows) are skipped. The sums are exact whatever the bound used (it
        only sizes the exact products), so they are the same integers either way."""
        cols = np.asarray(cols)
        if cols.dtype not in (np.float32, np.float64) or cols.shape[:2] != self.shape:
            raise ValueError(
                f"update_rows takes float (G, K, rows) = {(*self.shape, 'rows')} integer "
                f"codes, got {cols.dtype} {cols.shape}"
            )
        if bound is None and not np.array_equal(np.rint(cols), cols):
            raise ValueError("update_rows takes integer codes; got non-integer values")
        m = self._bound(cols, bound)
        if cols.dtype != _exact_dtype(m):
            cols = cols.astype(_exact_dtype(m))
        self._buffer(cols, m)

    @staticmethod
    def _bound(c: np.ndarray, known: int | None = None) -> int:
        """The largest code magnitude of ``c`` (``known``: a bound given instead), checked
        to allow an exact Hessian."""
        m = max(int(c.max(initial=0)), -int(c.min(initial=0))) if known is None else int(known)
        if m * m > _EXACT_INT[np.dtype(np.float64)]:
            raise ValueError(f"codes up to {m} are too large for an exact Hessian")
        return m

    def _buffer(self, cols: np.ndarray, m: int) -> None:
        """Buffer (or sum) the batch ``cols`` ``(G, K, rows)`` of codes up to ``m``."""
        dtype = cols.dtype
        self.rows += cols.shape[2]
        if not self.products:  # row sums only: nothing to buffer
            self._add(cols)
            return
        if self._pending and self._pending[0].dtype != dtype:
            self.flush()
        limit = _EXACT_INT[dtype]
        sq = column_squares(cols, m)
        if sq.max(initial=0) > limit:  # this batch alone: products of a bounded number of rows
            self.flush()
            step = _exact_step(m)
            for a in range(0, cols.shape[2], step):
                self._add(cols[:, :, a : a + step])
            return
        if self._pending and (self._pending_sq + sq).max(initial=0) > limit:
            self.flush()
        self._pending_sq = sq if not self._pending else self._pending_sq + sq
        self._pending.append(cols)
        self._pending_size += cols.size
        if self._pending_size >= FLUSH:
            self.flush()

    def flush(self) -> None:
        """Add the buffered rows to the int64 sums: one product, exact (the buffer's
        columns have sums of squares within float32's or float64's exact integers)."""
        pending = self._pending
        if not pending:
            return
        cols = pending[0] if len(pending) == 1 else np.concatenate(pending, axis=2)
        self._pending, self._pending_sq, self._pending_size = [], None, 0
        self._add(cols)

    def _add(self, cols: np.ndarray) -> None:
        """Add the rows of ``cols`` (G, K, rows), whose product is exact, to the sums."""
        if self.row_sum is None:
            g, k = self.shape
            self.sum = np.zeros((g, k, k), np.int64) if self.products else None
            self.row_sum = np.zeros((g, k), np.int64)
        # float64 sums of integers below 2**53: exact (nan: a non-integer code slipped in)
        sums = cols.sum(axis=2, dtype=np.float64)
        if np.isnan(sums).any():
            raise ValueError("CodeHessian takes integer codes; got nan")
        if self.products:
            add_gram(cols, self.sum)
        self.row_sum += sums.astype(np.int64)

    def __getstate__(self) -> dict:
        self.flush()  # a shard's statistics travel summed
        return self.__dict__

    def merge(self, other: CodeHessian) -> None:
        """Add ``other``'s rows: exactly the Hessian of both batches' rows, in any order."""
        self.flush()
        other.flush()
        if (other.shape, other.scale, other.products) != (self.shape, self.scale, self.products):
            raise ValueError(
                f"cannot merge CodeHessians of shapes/scales/products {other.shape}/"
                f"{other.scale}/{other.products} and {self.shape}/{self.scale}/{self.products}"
            )
        if other.row_sum is not None:
            if self.row_sum is None:
                self.sum = None if other.sum is None else other.sum.copy()
                self.row_sum = other.row_sum.copy()
            else:
                if self.products:
                    self.sum += other.sum
                self.row_sum += other.row_sum
        self.rows += other.rows

    def matrix(self) -> np.ndarray:
        self._check()
        if not self.products:
            raise ValueError("this CodeHessian sums no products (products=False): no matrix")
        self.flush()
        return (2.0 * self.scale * self.scale / self.rows) * self.sum

    def mean(self) -> np.ndarray:
        self._check()
        self.flush()
        return (self.scale / self.rows) * self.row_sum


def output_error(dw: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Per output row, ``dw_r H dw_r^T``: with ``H = 2 X^T X / n`` this is ``2/n`` times the
    squared error that the weight error ``dw`` adds to that output channel on the data.

    ``dw`` is ``(G, O, K)`` (or ``(O, K)`` with ``h`` ``(K, K)``); returns ``(G, O)``
    (``(O,)``). An error of 1 on the first input of a layer whose inputs are [1, 0] and
    [1, 2] (H from the :class:`Hessian` example) costs ``2/2 * (1 + 1) = 2``:

    >>> output_error(np.array([[1.0, 0.0]]), np.array([[2.0, 2.0], [2.0, 4.0]]))
    array([2.])
    """
    dw = np.asarray(dw, np.float64)
    h = np.asarray(h, np.float64)
    if dw.ndim == 2:
        return output_error(dw[None], h[None])[0]
    return np.einsum("gok,gok->go", np.matmul(dw, h), dw)
