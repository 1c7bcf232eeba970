"""Fixed-range histograms: the observer shared by ``percentile``, ``kl`` and ``mse``.

A :class:`HistogramObserver` is created with the exact ``data_range=(lo, hi)`` of the
tensor (scalars, or one value per channel), gathered by the calibrate driver in a first
min/max pass. Its bins are therefore fixed before any data arrives: counts are integers
added batch by batch, so the histogram does not depend on the order of the batches, two
shards merge exactly (same range, add the counts), and memory is ``bins`` integers per
channel and per kind, whatever the number of batches (plus, for batches of short rows, fewer
than :func:`batch_width` values per row kept to be binned together). Each value's bin depends
on that value alone, so the counts do not depend on how the data is batched either; the calibrators'
``choose_range`` is a function of the counts and the range only, so it runs once, where the
states are merged. :meth:`HistogramObserver.state` is the range and the int64 counts.

Two kinds of histogram, each a ``(C, bins)`` int64 array (``C = 1`` per-tensor):

* ``"signed"``: the values over ``[lo, hi]``;
* ``"abs"``: the magnitudes ``|x|`` over ``[0, max(|lo|, |hi|)]``.

Binning is exactly :func:`numpy.histogram` with ``range=`` in float64: edges
``np.linspace(lo, hi, bins + 1)``, bin ``k`` holds ``edges[k] <= v < edges[k + 1]`` and the
last bin also holds ``hi``; a degenerate range ``lo == hi`` is widened to
``[lo - 0.5, hi + 0.5]`` as numpy does, or by one ulp where ``0.5`` would be lost to
rounding (``|lo| >= 2**52``) and numpy's bins would be empty intervals (the calibrators return
such a range unchanged).
Compared with ONNX Runtime, TensorRT and torch, which grow or re-bin their histograms when a
later batch exceeds the range seen so far (order-dependent, or approximate in torch's
upsampled re-binning), nothing here is approximate; and unlike ONNX Runtime no activation is
ever stored.

The calibrator owning the observer provides ``bins``, ``kinds`` and
``choose_range(observer, spec) -> (rmin, rmax)`` (arrays of shape ``(C,)``); what every
histogram calibrator shares (``needs_range``, the observer, the ``bins`` check) is
:class:`HistogramMethod`, and :class:`HistogramCalibrator` is the frozen dataclass for the
methods whose only option is ``bins``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ._common import as_channels, batch_minmax, check_state, no_data, range_qparam

__all__ = [
    "FLOAT32_EXACT",
    "HistogramCalibrator",
    "HistogramMethod",
    "HistogramObserver",
    "UniformBins",
    "batch_width",
    "check_bins",
    "float32_estimate",
    "float32_thresholds",
    "group_rows",
    "histogram",
]


def check_bins(owner: Any, bins: Any) -> None:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{type(owner).__name__}.bins must be a positive integer, got {bins!r}")


BLOCK = 1 << 16  # elements per block: the temporaries stay in cache (numpy does the same)
#: bytes of thresholds and counts of the rows binned together (:func:`group_rows`): half of
#: a 1 MB L2 cache
GROUP_BYTES = 1 << 19


def _bin_block(rows: np.ndarray, edges: np.ndarray) -> np.ndarray:
    c, bins = edges.shape[0], edges.shape[1] - 1
    lo, hi = edges[:, :1], edges[:, -1:]
    idx = ((rows - lo) / (hi - lo) * bins).astype(np.intp)
    np.clip(idx, 0, bins - 1, out=idx)
    flat = edges.ravel()
    pos = idx + (np.arange(c) * (bins + 1))[:, None] if c > 1 else idx.copy()
    down = rows < flat[pos]
    idx -= down
    pos -= down
    idx += (rows >= flat[pos + 1]) & (idx != bins - 1)
    if c > 1:
        idx += (np.arange(c) * bins)[:, None]
    return np.bincount(idx.ravel(), minlength=c * bins).reshape(c, bins)


#: dtypes whose every value is a float32 exactly: binned in float32 (:func:`histogram`)
FLOAT32_EXACT = frozenset(
    np.dtype(t) for t in ("float32", "float16", "int8", "uint8", "int16", "uint16")
)


def float32_thresholds(edges: np.ndarray) -> np.ndarray:
    """Per row, the smallest float32 at or above each float64 edge but the last, then two
    ``+inf``: for a float32 ``v`` below the last edge, ``v >= edges[c, k]`` exactly when
    ``v >= t[c, k]``, so float32 values are binned against float64 edges without leaving
    float32; the last bin is closed (``+inf`` where its upper edge was).

    >>> float32_thresholds(np.array([[0.0, 0.7, 1.0]])).tolist()  # float32(0.7) < 0.7
    [[0.0, 0.7000000476837158, inf, inf]]
    """
    t = edges[:, :-1].astype(np.float32)
    below = t.astype(np.float64) < edges[:, :-1]
    t[below] = np.nextafter(t[below], np.float32(np.inf))
    inf = np.full((t.shape[0], 2), np.inf, np.float32)
    return np.ascontiguousarray(np.concatenate([t, inf], axis=1))


def float32_estimate(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(lo, k)`` as float32 ``(C, 1)`` arrays such that ``(v - lo) * k`` computed in
    float32 is within a quarter of a bin of ``v``'s position (in bins from ``lo``) for every
    ``v`` in the range, or None when float32 cannot guarantee that (a range narrow next to
    its magnitude, or beyond ``2**126``: float64 then). The bound: the error of ``lo`` and
    ``k`` in float32 and three float32 roundings, below a quarter of a bin.

    >>> [a.tolist() for a in float32_estimate(np.linspace([-1.0], [3.0], 9, axis=-1))]
    [[[-1.0]], [[2.0]]]
    """
    bins = edges.shape[1] - 1
    lo, span = edges[:, 0], edges[:, -1] - edges[:, 0]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # (checked below)
        k = bins / span
        lo32, k32 = lo.astype(np.float32), k.astype(np.float32)
        err = (
            np.abs(lo32 - lo) * k + np.abs(k32 / k - 1.0) * (bins + 1) + 3.0 * 2.0**-24 * (bins + 2)
        )
    small = np.all(np.abs(edges[:, [0, -1]]) < 2.0**126)  # (v - lo never overflows)
    if not (small and np.all(np.isfinite(k32)) and np.all(err < 0.25)):
        return None
    return lo32[:, None], k32[:, None]


def _nearest_edges(rows: np.ndarray, est: tuple, lower: np.ndarray, offsets) -> np.ndarray:
    """Each float32 value of ``rows`` as ``1 + its bin``, offset by its row's ``offsets``
    (None for one row) into rows of ``bins + 2`` counts (``est``: :func:`float32_estimate`;
    ``lower``: :func:`float32_thresholds` flat). ``r``, the nearest integer to the estimate
    ``(v - lo) * k``, is within 3/4 of a bin of ``v``'s position (the estimate is off by
    less than a quarter, adding ``0.5`` in float32 by less than ``2**-24 * (bins + 1)``),
    so ``v``'s bin is ``r - 1`` or ``r``: one comparison with the threshold of edge ``r``
    decides (edge ``bins`` is ``+inf``: the last bin is closed).

    >>> edges = np.linspace([0.0], [1.0], 3, axis=-1)  # bins [0, .5), [.5, 1]
    >>> rows = np.array([[0.0, 0.49, 0.5, 0.74, 1.0]], np.float32)
    >>> _nearest_edges(rows, float32_estimate(edges), float32_thresholds(edges).ravel(), None)
    array([[1, 1, 2, 2, 2]], dtype=int32)
    """
    v = np.subtract(rows, est[0])
    v *= est[1]
    v += 0.5
    r = v.astype(np.int32)  # (v > 1/4: truncation is rounding down)
    if offsets is not None:
        r += offsets
    r += rows >= lower.take(r)
    return r


class UniformBins:
    """Per-row uniform bins ``edges (C, bins+1)`` ready to count values in (the float32
    thresholds and estimate are computed once: :func:`float32_thresholds`,
    :func:`float32_estimate`)."""

    def __init__(self, edges: np.ndarray):
        self.edges = edges
        c, width = edges.shape[0], edges.shape[1] + 1  # rows of bins + 2 thresholds
        self.est = float32_estimate(edges)
        if c * width >= 2**31:  # (int32 indices into the thresholds)
            self.est = None
        if self.est is not None:
            self.lower = float32_thresholds(edges).ravel()
            rows = np.arange(c, dtype=np.int32)[:, None]
            self.offsets = None if c == 1 else rows * width
            self.shift = rows * 2 + 1  # from 1 + bin in rows of bins + 2 to bin in rows of bins

    def add(self, rows: np.ndarray, out: np.ndarray, absolute: bool = False) -> None:
        """Add the :func:`histogram` of ``rows`` in these bins to ``out`` (C-contiguous
        int64 ``(C, bins)``), in groups of :func:`group_rows` rows (their thresholds and
        counts stay in cache), each in blocks of about ``BLOCK`` values."""
        group = group_rows(rows.shape[0], self.edges.shape[1] - 1)
        for c0 in range(0, rows.shape[0], group):
            c1 = min(c0 + group, rows.shape[0])
            step = max(1, BLOCK // (c1 - c0))
            for j in range(0, rows.shape[1], step):
                self._add_block(rows[c0:c1, j : j + step], c0, out[c0:c1], absolute)

    def _add_block(self, block: np.ndarray, c0: int, out: np.ndarray, absolute: bool) -> None:
        """Add the counts of ``block``, rows ``c0, c0 + 1, ...`` of the bins, to ``out``."""
        c, width = block.shape[0], self.edges.shape[1] + 1
        if self.est is None or block.dtype not in FLOAT32_EXACT:
            block = block.astype(np.float64, order="C")
            out += _bin_block(np.abs(block, out=block) if absolute else block, self.edges[c0:][:c])
            return
        if absolute:
            block = np.abs(block, dtype=np.float32)
        elif block.dtype != np.float32:
            block = block.astype(np.float32)
        est = (self.est[0][c0:][:c], self.est[1][c0:][:c])
        lower = self.lower[c0 * width :][: c * width]
        idx = _nearest_edges(block, est, lower, None if c == 1 else self.offsets[:c])
        if idx.size >= out.size:
            counts = np.bincount(idx.ravel(), minlength=c * width)
            out += counts.reshape(c, width)[:, 1:-1]
        else:  # fewer values than bins (many channels, short rows): no zeroed counts
            np.add.at(out.reshape(-1), (idx - self.shift[:c]).ravel(), 1)


def group_rows(channels: int, bins: int) -> int:
    """How many rows of a histogram of ``bins`` bins per row :meth:`UniformBins.add` bins
    together: as many as fit their float32 thresholds and int64 counts in
    :data:`GROUP_BYTES` (a row's values only touch its own row of both), at least one. Many
    channels binned all at once (blocks of all the rows) spread every block over every
    row's thresholds and counts (3 MB for 192 channels of 2048 bins): measured 16-29 ns per
    value against 5-7 in groups, on PP-OCRv4 det's per-channel histograms.

    >>> group_rows(192, 2048), group_rows(1, 2048), group_rows(4, 10**6)
    (21, 1, 1)
    """
    return max(1, min(channels, GROUP_BYTES // (12 * (bins + 2))))


def batch_width(bins: int) -> int:
    """Values per row that :class:`HistogramObserver` bins at once, at least: two per bin
    (a row's thresholds and counts are read once for every two values).

    >>> batch_width(2048)
    4100
    """
    return 2 * (bins + 2)


def histogram(rows: np.ndarray, edges: np.ndarray, absolute: bool = False) -> np.ndarray:
    """Counts ``(C, bins)`` of ``rows (C, M)`` (or of ``|rows|``) in per-row uniform bins
    ``edges (C, bins+1)``, every value inside ``[edges[c, 0], edges[c, -1]]``: exactly
    ``np.histogram`` of each row in float64.

    The index is first estimated arithmetically, then corrected by comparing with the
    edges (the estimate can be one bin off within an ulp of an edge), as numpy does; the
    columns are processed in blocks of about ``BLOCK`` elements. Values that are float32
    exactly (float32, float16, 8/16-bit integers) are binned in float32 against
    :func:`float32_thresholds` when :func:`float32_estimate` allows it: the same counts
    for half the memory traffic. Many batches into the same bins: :class:`UniformBins`.

    >>> edges = np.linspace([0.0], [1.0], 3, axis=-1)
    >>> histogram(np.array([[0.0, 0.1, 0.5, 1.0]], np.float32), edges)
    array([[2, 2]])
    """
    counts = np.zeros((rows.shape[0], edges.shape[1] - 1), np.int64)
    UniformBins(edges).add(rows, counts, absolute)
    return counts


class HistogramObserver:
    """Per-channel fixed-range histograms of the kinds ``calibrator.kinds``."""

    def __init__(self, calibrator: Any, axis: int | None, data_range) -> None:
        if data_range is None:
            raise ValueError(
                f"the {calibrator.name!r} calibrator builds histograms over a fixed range and "
                "needs data_range=(lo, hi): run a min/max pass first (calibrate() does)"
            )
        lo, hi = (np.atleast_1d(np.asarray(v, np.float64)) for v in data_range)
        if lo.ndim != 1 or lo.shape != hi.shape:
            raise ValueError(f"data_range must be two scalars or two 1-D arrays, got {data_range}")
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(lo <= hi)):
            raise ValueError(f"data_range must be finite with lo <= hi, got {data_range}")
        if axis is None and lo.size != 1:
            raise ValueError("a per-tensor observer (axis=None) needs a scalar data_range")
        self.calibrator = calibrator
        self.axis = axis
        self.lo, self.hi = lo, hi
        self.edges: dict[str, np.ndarray] = {}
        self._bins: dict[str, UniformBins] = {}
        self._counts: dict[str, np.ndarray] | None = None
        self._pending: list[np.ndarray] = []  # batches not binned yet (short rows)
        self._pending_width = 0  # their values per row

    @property
    def channels(self) -> int:
        return self.lo.size

    @property
    def counts(self) -> dict[str, np.ndarray] | None:
        """kind -> int64 ``(C, bins)`` counts of every batch so far (None before any)."""
        self._flush()
        return self._counts

    @property
    def kept(self) -> int:
        """Values per row kept to be binned with the next batches (:meth:`update`)."""
        return self._pending_width

    def __getstate__(self) -> dict:
        self._flush()  # (sent with every batch binned)
        return self.__dict__

    def _start(self, channels: int) -> None:
        """Fix the channel count (a scalar range is shared by all channels) and the edges."""
        if self.lo.size == 1 and channels != 1:
            self.lo = np.full(channels, self.lo[0])
            self.hi = np.full(channels, self.hi[0])
        if self.lo.size != channels:
            raise ValueError(f"data_range has {self.lo.size} channels, the batch has {channels}")
        for kind in self.calibrator.kinds:
            lo, hi = self.bounds(kind)
            pad = np.where(lo == hi, np.maximum(0.5, np.spacing(np.abs(lo))), 0.0)
            lo, hi = lo - pad, hi + pad
            self.edges[kind] = np.linspace(lo, hi, self.calibrator.bins + 1, axis=-1)
            self._bins[kind] = UniformBins(self.edges[kind])
        self._counts = {k: np.zeros((channels, self.calibrator.bins), np.int64) for k in self.edges}

    def bounds(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """The (unwidened) range ``(lo, hi)`` per channel of the histogram ``kind``."""
        if kind == "abs":
            return np.zeros_like(self.lo), np.maximum(-self.lo, self.hi)
        return self.lo, self.hi

    def update(self, x) -> None:
        """Check the batch ``x`` against the range and add it to the counts: at once when
        its rows have at least :func:`batch_width` values, else copied and binned with the
        next batches once their rows have that many (a batch's values touch every row's
        thresholds and counts: 2048-bin rows of 225 values, a per-channel histogram of a
        15x15 image, cost 29 ns per value binned one sample at a time, 6 in batches). The
        counts are integers: the same whatever the batches binned together."""
        rows = as_channels(x, self.axis)
        if rows.size == 0:
            return
        if self._counts is None:
            self._start(rows.shape[0])
        elif rows.shape[0] != self.channels:
            raise ValueError(f"channel count changed from {self.channels} to {rows.shape[0]}")
        bmin, bmax = batch_minmax(rows)
        if np.any(bmin < self.lo) or np.any(bmax > self.hi):
            raise ValueError(
                f"batch range [{bmin.min()}, {bmax.max()}] is outside the data_range "
                f"[{self.lo.min()}, {self.hi.max()}] this observer was created with"
            )
        width = batch_width(self.calibrator.bins)
        if not self._pending and rows.shape[1] >= width:
            self._add(rows)
            return
        self._pending.append(np.array(rows))  # (a copy: the caller may reuse its buffer)
        self._pending_width += rows.shape[1]
        if self._pending_width >= width:
            self._flush()

    def _add(self, rows: np.ndarray) -> None:
        for kind, bins in self._bins.items():
            bins.add(rows, self._counts[kind], absolute=kind == "abs")

    def _flush(self) -> None:
        """Bin the batches :meth:`update` kept, together."""
        if self._pending:
            pending, self._pending, self._pending_width = self._pending, [], 0
            self._add(pending[0] if len(pending) == 1 else np.concatenate(pending, axis=1))

    def merge(self, other: HistogramObserver) -> None:
        if not (
            isinstance(other, HistogramObserver)
            and other.calibrator == self.calibrator
            and other.axis == self.axis
        ):
            raise TypeError("can only merge histogram observers of the same calibrator and axis")
        self.merge_state(other.state())

    def state(self) -> dict[str, np.ndarray]:
        """``{"lo", "hi": float64 (C,), "counts.<kind>": int64 (C, bins)}``; the counts
        have ``C = 0`` rows before any data. The edges are not sent: they follow from the
        range and ``bins``."""
        bins = self.calibrator.bins
        out = {"lo": self.lo.copy(), "hi": self.hi.copy()}
        for kind in self.calibrator.kinds:
            counts = None if self.counts is None else self.counts[kind]
            out[f"counts.{kind}"] = (
                np.zeros((0, bins), np.int64) if counts is None else counts.copy()
            )
        return out

    def merge_state(self, state: dict[str, np.ndarray]) -> None:
        keys = ("lo", "hi", *(f"counts.{k}" for k in self.calibrator.kinds))
        state = check_state(self, state, keys)
        channels = state[keys[2]].shape[0]
        if channels == 0:
            return
        if any(state[k].shape != (channels, self.calibrator.bins) for k in keys[2:]):
            raise ValueError(
                f"{self.calibrator.name}: cannot merge histograms of shape "
                f"{state[keys[2]].shape} into {self.calibrator.bins} bins"
            )
        if self.counts is None:
            self._start(channels)
        if not (np.array_equal(self.lo, state["lo"]) and np.array_equal(self.hi, state["hi"])):
            raise ValueError(
                "cannot merge histograms over different data ranges: give every shard the "
                "global data_range"
            )
        for kind in self.calibrator.kinds:
            self.counts[kind] += state[f"counts.{kind}"].astype(np.int64)

    def compute(self, spec):
        if self.counts is None:
            raise no_data()
        rmin, rmax = self.calibrator.choose_range(self, spec)
        return range_qparam(rmin, rmax, spec, self.axis)


class HistogramMethod:
    """Mixed into every histogram calibrator (a frozen dataclass with a ``bins`` option and
    the class attribute ``kinds``, the histograms it reads in ``choose_range``): it needs the
    data range, observes with a :class:`HistogramObserver` and checks ``bins``."""

    name: ClassVar[str]
    needs_range: ClassVar[bool] = True
    kinds: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        check_bins(self, self.bins)

    def observer(self, axis: int | None = None, data_range=None) -> HistogramObserver:
        return HistogramObserver(self, axis, data_range)


@dataclass(frozen=True)
class HistogramCalibrator(HistogramMethod):
    """A histogram method whose only option is ``bins``: subclasses add ``kinds`` and
    ``choose_range`` and stay frozen dataclasses without a decorator of their own."""

    bins: int = 2048
