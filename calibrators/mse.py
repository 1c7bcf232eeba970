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

Vectorized: the walk's skips of unchanged spans (long runs when one bin holds much mass,
e.g. clipped ReLU6 outputs) are jumped with one search instead of one step each, and the
errors of the spans are computed in blocks, one ``(spans, bins)`` array per block.

Differences from torch: the histogram covers the exact data range (torch re-bins with
16x upsampling when the range grows); quantile bounds are step counts (torch accumulates
``alpha += 1e-5`` in floats); all arithmetic is float64.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import ClassVar

import numpy as np

from . import register
from ._histogram import HistogramCalibrator, HistogramObserver

STEPS = 100_000  # 1 / torch's stepsize 1e-5
_ALPHA = np.arange(STEPS + 1) / STEPS  # alpha after a steps
_BETA = 1.0 - _ALPHA  # beta after b steps


def _cube_integral(begin, end):
    """``integral_begin^end x**2 dx``."""
    return (end * end * end - begin * begin * begin) / 3.0


def span_errors(hist: np.ndarray, width: float, starts, ends, dst_bins: int) -> np.ndarray:
    """L2 quantization error of each span ``[starts[k], ends[k]]`` (bin indices, inclusive)
    of a histogram with bins of ``width``, onto ``dst_bins`` destination bins."""
    starts = np.asarray(starts, np.float64)[:, None]
    ends = np.asarray(ends, np.float64)[:, None]
    dst_width = width * (ends - starts + 1.0) / dst_bins
    src = np.arange(hist.size, dtype=np.float64)[None, :]
    begin = (src - starts) * width
    end = begin + width
    first = np.clip(np.floor(begin / dst_width), 0, dst_bins - 1)
    last = np.clip(np.floor(end / dst_width), 0, dst_bins - 1)
    half = dst_width / 2.0
    density = hist[None, :] / width
    norm = _cube_integral(begin - (first + 0.5) * dst_width, half)
    norm = norm + (last - first - 1.0) * _cube_integral(-half, half)
    norm = norm + _cube_integral(-half, end - (last * dst_width + half))
    return (density * norm).sum(axis=1)


def _walk(cum: np.ndarray) -> Iterator[tuple[int, int]]:
    """The spans the greedy walk visits, in order, assuming it never stops early."""
    total = cum[-1]
    a = b = 0
    s, e = 0, cum.size - 1
    while a + b < STEPS:
        l = min(max(s, int(np.searchsorted(cum, total * _ALPHA[a + 1], "left"))), e)
        r = max(min(e, int(np.searchsorted(cum, total * _BETA[b + 1], "right")) - 1), s)
        if l - s > e - r:
            s, a = l, a + 1
        elif r < e:
            e, b = r, b + 1
        else:
            # l == s and r == e: torch steps beta until r moves; jump to that step directly:
            # the first b with total * beta(b) < cum[e] (a monotone condition: bisect it)
            if s == e:
                return
            c = cum[e]
            b = bisect_left(range(STEPS + 1), True, key=lambda k: total * _BETA[k] < c) - 1
            continue
        yield s, e


def mse_span(hist: np.ndarray, width: float, dst_bins: int) -> tuple[int, int]:
    """The bin span ``(s, e)`` the greedy L2 search settles on."""
    walk = _walk(np.cumsum(hist, dtype=np.float64))
    best = (0, hist.size - 1)
    best_norm = np.inf
    block = 8
    while True:
        spans = [span for _, span in zip(range(block), walk, strict=False)]
        if not spans:
            return best
        starts, ends = zip(*spans, strict=True)
        for span, norm in zip(spans, span_errors(hist, width, starts, ends, dst_bins), strict=True):
            if norm > best_norm:
                return best
            best, best_norm = span, norm
        block = min(2 * block, 64)


@register("mse")
class MSE(HistogramCalibrator):
    """torch HistogramObserver's L2 search (see the module docstring)."""

    kinds: ClassVar[tuple[str, ...]] = ("signed",)

    def choose_range(self, obs: HistogramObserver, spec) -> tuple[np.ndarray, np.ndarray]:
        qmin, qmax = spec.qrange
        counts, edges = obs.counts["signed"], obs.edges["signed"]
        rmin, rmax = obs.lo.copy(), obs.hi.copy()
        for c in np.flatnonzero(obs.lo < obs.hi):
            width = (obs.hi[c] - obs.lo[c]) / self.bins
            s, e = mse_span(counts[c].astype(np.float64), width, qmax - qmin + 1)
            rmin[c], rmax[c] = edges[c, s], edges[c, e + 1]
        return rmin, rmax
