"""``mse``: the L2-error search of torch's ``HistogramObserver`` (``_non_linear_param_search``).

Options: ``bins`` (default 2048). The signed histogram over ``[lo, hi]`` (:mod:`._histogram`,
``needs_range``). Candidate ranges are bin spans ``[edges[s], edges[e + 1]]``, found by a
greedy walk from the full span: with quantile bounds ``alpha = a / 100000`` and
``beta = 1 - b / 100000`` (``a``, ``b`` the numbers of steps taken, ``a + b < 100000``), each
step computes ``l``, the first bin (from ``s``) whose cumulative count reaches
``alpha' * total`` and ``r``, the last bin (down from ``e``) whose cumulative count is at most
``beta' * total`` (``alpha' = alpha + 1e-5``, ``beta' = beta - 1e-5``), and moves the side
that drops more bins (the start if ``l - s > e - r``, else the end), taking that step of
alpha or beta. Every new span's L2 error is computed; the walk stops at the first span
whose error exceeds the previous one, and the last span kept is the range.

The error of a span models each source bin as uniform and quantizes it onto ``D``
destination bins of width ``(edges[e+1] - edges[s]) / D`` (values outside the span go to
the first / last destination bin), integrating ``(x - center)**2`` in closed form, as torch
does. ``D`` is the number of integers of the spec's range (``qmax - qmin + 1``: 256 for
int8, 255 with ``narrow_range``, 128 with ``reduce_range``); torch always uses ``2**bits``.
The spec's ``symmetric`` is applied afterwards (``max(|rmin|, |rmax|)``), as in torch.

Vectorized: every channel walks at once, one step of all the channels still walking per
numpy pass (:func:`mse_spans`; the searches are bisections over the rows, one
``searchsorted`` when one row is left), each error computed from the non-empty bins of its
channel only (:func:`span_terms`, put back in place for the sum: the same float as over
every bin), in blocks of rows that stay in cache; and the walk's skips of unchanged spans
(long runs when one bin holds much mass, e.g. clipped ReLU6 outputs) are jumped with one
search instead of one step each.

Differences from torch: the histogram covers the exact data range (torch re-bins with
16x upsampling when the range grows); quantile bounds are step counts (torch accumulates
``alpha += 1e-5`` in floats); all arithmetic is float64.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import numpy as np

from . import register
from ._histogram import HistogramCalibrator, HistogramObserver

STEPS = 100_000  # 1 / torch's stepsize 1e-5
BLOCK = 1 << 16  # error terms computed at once
_ALPHA = np.arange(STEPS + 1) / STEPS  # alpha after a steps
_BETA = 1.0 - _ALPHA  # beta after b steps


def _cube_integral(begin, end):
    """``integral_begin^end x**2 dx``."""
    return (end * end * end - begin * begin * begin) / 3.0


def span_terms(hist, src, width, starts, ends, dst_bins: int) -> np.ndarray:
    """Each source bin's part of the L2 error of the span ``[starts[k], ends[k]]`` (bin
    indices, inclusive), row ``k``: ``hist`` the counts of the source bins ``src`` (one row
    of each per span, or one row shared by all), bins of ``width`` (a scalar or one per
    span), onto ``dst_bins`` destination bins. Each term depends on its own bin and span
    alone: the same float whichever other bins and spans are computed with it.

    >>> # 8 values uniform over [1, 3) in bins of width 1, onto 2 bins over [0, 4)
    >>> span_terms(np.array([0.0, 4.0, 4.0, 0.0]), np.arange(4.0), 1.0, [0], [3], 2).tolist()
    [[0.0, 1.3333333333333333, 1.3333333333333333, 0.0]]
    """
    starts = np.asarray(starts, np.float64)[:, None]
    ends = np.asarray(ends, np.float64)[:, None]
    width = np.asarray(width, np.float64)
    width = width[:, None] if width.ndim else width
    dst_width = width * (ends - starts + 1.0) / dst_bins
    begin = (np.atleast_2d(src) - starts) * width
    end = begin + width
    first = np.clip(np.floor(begin / dst_width), 0, dst_bins - 1)
    last = np.clip(np.floor(end / dst_width), 0, dst_bins - 1)
    half = dst_width / 2.0
    density = np.atleast_2d(hist) / width
    norm = _cube_integral(begin - (first + 0.5) * dst_width, half)
    norm = norm + (last - first - 1.0) * _cube_integral(-half, half)
    norm = norm + _cube_integral(-half, end - (last * dst_width + half))
    return density * norm


def span_errors(hist: np.ndarray, width, starts, ends, dst_bins: int) -> np.ndarray:
    """L2 quantization error of each span ``[starts[k], ends[k]]`` of the histogram ``hist``
    ``(bins,)`` (or one per span, ``(spans, bins)``) with bins of ``width``: the sum of its
    :func:`span_terms` over all the bins.

    >>> h = np.array([0.0, 4.0, 4.0, 0.0])  # 8 values uniform over [1, 3), bins of width 1
    >>> span_errors(h, 1.0, [0, 1], [3, 2], 2).tolist()  # onto 2 bins over [0, 4), [1, 3)
    [2.6666666666666665, 0.6666666666666666]
    """
    src = np.arange(hist.shape[-1], dtype=np.float64)
    return span_terms(hist, src, width, starts, ends, dst_bins).sum(axis=1)


def _bisect(ok, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per row, the first ``i`` in ``[lo, hi)`` with ``ok(rows, i)`` true, ``hi`` where none
    is (``ok`` monotone along each row: false then true); ``ok`` gets the rows still
    searched and an index for each.

    >>> _bisect(lambda rows, i: i >= np.array([3, 0, 9])[rows], np.zeros(3, int), np.full(3, 5))
    array([3, 0, 5])
    """
    lo, hi = lo.copy(), hi.copy()
    rows = np.flatnonzero(lo < hi)
    while rows.size:
        mid = (lo[rows] + hi[rows]) // 2
        yes = ok(rows, mid)
        hi[rows[yes]] = mid[yes]
        lo[rows[~yes]] = mid[~yes] + 1
        rows = rows[lo[rows] < hi[rows]]
    return lo


def _reaches(flat, base, x, strict: bool, rows, i):
    """``cum[row, i] > x[row]`` (``strict``) or ``>=``, ``flat`` the rows of ``cum`` one
    after the other from ``base[row]``."""
    v = flat[base[rows] + i]
    return v > x[rows] if strict else v >= x[rows]


def _first_reaching(flat, base, x, strict: bool, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per row, the first ``i`` in ``[lo, hi)`` with ``cum[row, i] > x[row]`` (``strict``)
    or ``>=``, ``hi`` where none is (``flat``, ``base`` as for :func:`_reaches`). One row:
    :func:`numpy.searchsorted` on its (non-decreasing) cumulative counts, clipped to the
    interval, which is that first index; several: :func:`_bisect` over the rows.

    >>> cum = np.array([0.0, 2.0, 2.0, 5.0])
    >>> one, lo, hi = np.zeros(1, np.int64), np.array([1]), np.array([4])
    >>> [_first_reaching(cum, one, np.array([2.0]), s, lo, hi).tolist() for s in (False, True)]
    [[1], [3]]
    """
    if lo.size == 1:
        row = flat[base[0] : base[0] + int(hi[0])]  # (the row up to hi: no next row)
        i = np.searchsorted(row, x[0], side="right" if strict else "left")
        return np.array([min(max(int(i), int(lo[0])), int(hi[0]))])
    return _bisect(partial(_reaches, flat, base, x, strict), lo, hi)


def _beta_below(total, c, rows, k):
    """``total * beta(k) < c`` per row."""
    return total[rows] * _BETA[k] < c[rows]


def _nonempty_columns(hist: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
    """``(C, max(nonempty))``: each row's non-empty columns in order, then its last one
    repeated (a repeated column gets the same term: writing it twice is harmless).

    >>> _nonempty_columns(np.array([[0.0, 2.0, 0.0, 1.0], [5.0, 1.0, 1.0, 0.0]]), np.array([2, 3]))
    array([[1, 3, 3],
           [0, 1, 2]])
    """
    _, cz = np.nonzero(hist > 0)  # row by row, in order
    start = np.cumsum(nonempty) - nonempty
    k = np.minimum(np.arange(nonempty.max(initial=0)), nonempty[:, None] - 1)
    return cz[start[:, None] + k]


def _errors(hist, cols, nonempty, width, rows, s, e, dst_bins: int) -> np.ndarray:
    """:func:`span_errors` of the span ``(s[k], e[k])`` of row ``rows[k]`` of ``hist``, from
    the first ``nonempty`` columns ``cols`` of each row (:func:`_nonempty_columns`; None:
    all the columns), in blocks
    of rows of about ``BLOCK`` terms (temporaries that stay in cache)."""
    bins = hist.shape[1]
    out = np.empty(rows.size)
    step = max(1, BLOCK // bins)
    for j in range(0, rows.size, step):
        r, sl = rows[j : j + step], slice(j, j + step)
        if cols is None:
            out[sl] = span_errors(hist[r], width[r], s[sl], e[sl], dst_bins)
            continue
        keep = cols[r, : nonempty[r].max()]
        src = np.take_along_axis(hist[r], keep, axis=1)
        terms = span_terms(src, keep.astype(np.float64), width[r], s[sl], e[sl], dst_bins)
        full = np.zeros((r.size, bins))
        np.put_along_axis(full, keep, terms, axis=1)
        out[sl] = full.sum(axis=1)
    return out


def mse_spans(hist: np.ndarray, width: np.ndarray, dst_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The bin spans ``(s, e)`` the greedy L2 search settles on, for each row of ``hist``
    ``(C, bins)`` (float64 counts) with bins of ``width[c]``: the walk of the module
    docstring, one step of every row still walking at a time (numpy over the rows).

    >>> h = np.zeros((2, 64)); h[0, 20:40] = 100.0; h[0, 63] = 1.0; h[1, :] = 1.0
    >>> [v.tolist() for v in mse_spans(h, np.array([1.0, 0.5]), 256)]  # (s, e) per row
    [[20, 0], [63, 62]]
    """
    c, bins = hist.shape
    cum = np.cumsum(hist, axis=1, dtype=np.float64)
    flat, base = cum.ravel(), np.arange(c) * bins
    total = cum[:, -1]
    a, b = np.zeros(c, np.int64), np.zeros(c, np.int64)
    s, e = np.zeros(c, np.int64), np.full(c, bins - 1)
    best_s, best_e, best = s.copy(), e.copy(), np.full(c, np.inf)
    # the errors from the non-empty bins only, put back in place before the sum: the same
    # sum of the same terms (an empty bin's is 0, unless inf or NaN arise in its error:
    # impossible for widths far from the float64 limits, else every bin as before)
    nonempty = (hist > 0).sum(axis=1)
    sparse = bool(np.all((width > 1e-290) & (width * bins < 1e90) & (nonempty > 0)))
    cols = _nonempty_columns(hist, nonempty) if sparse else None
    live = np.flatnonzero(a + b < STEPS)
    while live.size:
        ls, le, lt = s[live], e[live], total[live]
        lbase = base[live]
        x = lt * _ALPHA[a[live] + 1]
        # l: the first bin of [s, e] whose cumulative count reaches x (e if none does)
        l = _first_reaching(flat, lbase, x, False, ls, le)
        y = lt * _BETA[b[live] + 1]
        # r: the last bin of [s, e] whose cumulative count is at most y (s if none is)
        r = np.maximum(_first_reaching(flat, lbase, y, True, ls, le + 1) - 1, ls)
        move_s = l - ls > le - r
        move_e = ~move_s & (r < le)
        stuck = ~move_s & ~move_e
        # l == s and r == e: torch steps beta until r moves; jump to the step before the
        # first b with total * beta(b) < cum[e] (monotone in b: bisected); a single bin
        # left ends the walk
        done = stuck & (ls == le)
        jump = live[stuck & ~done]
        if jump.size:
            ce, tj = flat[base[jump] + e[jump]], total[jump]
            k0 = np.zeros(jump.size, np.int64)
            first = _bisect(partial(_beta_below, tj, ce), k0, k0 + STEPS + 1)
            b[jump] = first - 1
        moved = live[move_s | move_e]
        ms = move_s[move_s | move_e]
        s[moved[ms]], a[moved[ms]] = l[move_s], a[moved[ms]] + 1
        e[moved[~ms]], b[moved[~ms]] = r[move_e], b[moved[~ms]] + 1
        stop = np.zeros(c, bool)
        stop[live[done]] = True
        if moved.size:
            norm = _errors(hist, cols, nonempty, width, moved, s[moved], e[moved], dst_bins)
            worse = norm > best[moved]
            stop[moved[worse]] = True
            keep = moved[~worse]
            best_s[keep], best_e[keep], best[keep] = s[keep], e[keep], norm[~worse]
        live = live[~stop[live] & (a[live] + b[live] < STEPS)]
    return best_s, best_e


@register("mse")
class MSE(HistogramCalibrator):
    """torch HistogramObserver's L2 search (see the module docstring)."""

    kinds: ClassVar[tuple[str, ...]] = ("signed",)

    def choose_range(self, obs: HistogramObserver, spec) -> tuple[np.ndarray, np.ndarray]:
        qmin, qmax = spec.qrange
        counts, edges = obs.counts["signed"], obs.edges["signed"]
        rmin, rmax = obs.lo.copy(), obs.hi.copy()
        rows = np.flatnonzero(obs.lo < obs.hi)
        width = (obs.hi[rows] - obs.lo[rows]) / self.bins
        s, e = mse_spans(counts[rows].astype(np.float64), width, qmax - qmin + 1)
        rmin[rows], rmax[rows] = edges[rows, s], edges[rows, e + 1]
        return rmin, rmax
