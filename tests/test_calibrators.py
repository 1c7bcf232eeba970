"""Calibrator plug-ins (``calibrators/*.py``) against plain reference computations.

Every reference below is written the straightforward way (Python loops, ``np.histogram``,
``np.digitize``, ``scipy.stats.entropy``, exact ``Fraction`` means), independently of the
vectorized code under test, and must give the *same* qparams and chosen range.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import entropy

from autoq import calibrators as cal
from autoq.calibrators._common import as_channels
from autoq.calibrators._histogram import batch_width, float32_estimate, histogram
from autoq.calibrators.kl import KL, kl_divergences, kl_threshold_bins
from autoq.calibrators.max import Max
from autoq.calibrators.moving_average import MovingAverage
from autoq.calibrators.mse import MSE, mse_spans, span_errors
from autoq.calibrators.percentile import Percentile
from autoq.config import QuantSpec
from autoq.qparams import QParam

# ---------------------------------------------------------------------------------------
# driver and data


def data_range(batches, axis):
    """What the calibrate driver's min/max pass gives: per-tensor or per-channel (lo, hi)."""
    if axis is None:
        return min(float(b.min()) for b in batches), max(float(b.max()) for b in batches)
    lo = np.min([np.moveaxis(b, axis, 0).reshape(b.shape[axis], -1).min(1) for b in batches], 0)
    hi = np.max([np.moveaxis(b, axis, 0).reshape(b.shape[axis], -1).max(1) for b in batches], 0)
    return lo, hi


def observe(calibrator, batches, axis=None, rng=None):
    obs = calibrator.observer(
        axis, rng or (data_range(batches, axis) if calibrator.needs_range else None)
    )
    for b in batches:
        obs.update(b)
    return obs


def same(a: QParam, b: QParam) -> bool:
    """Equal qparams *and* equal recorded ranges."""
    return a == b and np.array_equal(a.rmin, b.rmin) and np.array_equal(a.rmax, b.rmax)


_rng = np.random.default_rng(20261121)


def _gauss(*shape):
    return _rng.standard_normal(shape).astype(np.float32)


# Per-tensor edge cases: each is a list of batches.
DATASETS = {
    # plain activations: three batches of a normal distribution (enough values for MSE's
    # greedy search to clip both tails over dozens of steps)
    "gaussian": [_gauss(8, 8000) for _ in range(3)],
    # one huge value among 15000 (less than 0.01 %): max keeps it, percentile and KL must
    # clip it (MSE keeps it: see test_reference_edge_cases_behave_as_explained)
    "single_outlier": [_gauss(4, 1250), np.append(_gauss(4999), np.float32(60.0)), _gauss(5000)],
    # all zeros: every method must give a degenerate range (scale 1), never a division by 0
    "all_zero": [np.zeros(1000, np.float32)] * 2,
    # constant: the histogram range of x is empty (lo == hi), |x| has all mass in one bin
    "constant": [np.full(1000, 0.75, np.float32)] * 2,
    # negative-only: the range is widened to include 0 on the right
    "negative_only": [-np.abs(_gauss(3000)) - np.float32(0.5) for _ in range(2)],
    # ReLU6-like: spikes of exact 0s and 6s at both ends of the range
    "relu6": [np.clip(3 * _gauss(3000) + 1, 0, 6).astype(np.float32) for _ in range(2)],
}

SPECS = {
    "int8_sym_narrow": QuantSpec(symmetric=True, narrow_range=True),
    "int8_asym": QuantSpec(),
    "uint8_asym": QuantSpec(dtype="uint8"),
    "int8_asym_reduce": QuantSpec(reduce_range=True),
}


def _weights_with_zero_channel():
    """Conv weights (8, 3, 3, 3), per output channel (axis 0); channel 2 is all zero (a
    pruned filter: it must get scale 1, not a NaN) and channel 5 has a single outlier."""
    w = _gauss(8, 3, 3, 3) * np.linspace(0.1, 2, 8, dtype=np.float32)[:, None, None, None]
    w[2] = 0
    w[5, 1, 1, 1] = 9.0
    return [w]


WEIGHTS = _weights_with_zero_channel()


# ---------------------------------------------------------------------------------------
# references: per-tensor functions values -> (rmin, rmax), applied per channel when needed


def ref_max(values, spec):
    lo, hi = np.inf, -np.inf
    for v in values:
        lo, hi = min(lo, float(v)), max(hi, float(v))
    return lo, hi


def ref_percentile(values, spec, p=99.99, bins=2048):
    values = values.astype(np.float64)
    if spec.symmetric:
        a = np.abs(values)
        if a.max() == 0:
            return 0.0, 0.0
        hist, edges = np.histogram(a, bins=bins, range=(0, a.max()))
        running = 0
        for k in range(bins):
            running += hist[k]
            if running >= p / 100 * hist.sum():
                break
        return -edges[k + 1], edges[k + 1]  # upper edge of the crossing bin
    lo, hi = values.min(), values.max()
    if lo == hi:
        return lo, hi
    hist, edges = np.histogram(values, bins=bins, range=(lo, hi))
    running = 0
    for k in range(bins):
        running += hist[k]
        if running >= p / 100 * hist.sum():
            break
    running = 0
    for j in reversed(range(bins)):
        running += hist[j]
        if running >= p / 100 * hist.sum():
            break
    return edges[j], edges[k + 1]


_KL_CACHE: dict = {}  # the reference is slow (~0.5 s) and the same for several specs


def ref_kl_divergences(values, bins, levels):
    """NVIDIA's _compute_amax_entropy, one candidate at a time (np.digitize, scipy)."""
    key = (values.tobytes(), values.dtype.str, bins, levels)
    if key not in _KL_CACHE:
        _KL_CACHE[key] = _ref_kl_divergences(values, bins, levels)
    return _KL_CACHE[key]


def _ref_kl_divergences(values, bins, levels):
    a = np.abs(values.astype(np.float64))
    hist, edges = np.histogram(a, bins=bins, range=(0, a.max()))
    h = hist.astype(np.float64)
    h[0] = h[1]
    divergences = {}
    for i in range(levels, bins + 1):
        level = np.digitize(np.arange(i), np.linspace(0, i, levels + 1)) - 1
        level[h[:i] == 0] = -1
        used = level >= 0
        sums = np.bincount(level[used], weights=h[:i][used], minlength=levels)
        counts = np.bincount(level[used], minlength=levels)
        q = np.zeros(i)
        q[used] = sums[level[used]] / counts[level[used]]
        p = h[:i].copy()
        p[-1] += h[i:].sum()
        divergences[i] = entropy(p, q) if q.sum() > 0 else np.inf
    return divergences, edges


def ref_kl(values, spec, bins=2048):
    levels = 2 ** (8 * np.dtype(spec.dtype).itemsize - 1)
    amax = np.abs(values).max()
    if amax == 0:
        t = 0.0
    elif levels >= bins:
        t = float(amax)
    else:
        div, edges = ref_kl_divergences(values, bins, levels)
        best = min(div.values())
        t = edges[max(i for i, d in div.items() if d <= best + 1e-9)]  # NVIDIA: last argmin
    if spec.symmetric:
        return -t, t
    return (-t if values.min() < 0 else 0.0), (t if values.max() > 0 else 0.0)


def ref_mse(values, spec, bins=2048):
    """torch HistogramObserver._non_linear_param_search, step by step (alpha and beta as
    step counts), error against qmax - qmin + 1 destination bins."""
    values = values.astype(np.float64)
    lo, hi = values.min(), values.max()
    if lo == hi:
        return lo, hi
    qmin, qmax = spec.qrange
    dst_nbins = qmax - qmin + 1
    hist, edges = np.histogram(values, bins=bins, range=(lo, hi))
    hist = hist.astype(np.float64)
    bin_width = (hi - lo) / bins
    csum = np.cumsum(hist)
    total = csum[-1]

    def get_norm(delta_begin, delta_end, density):
        return density * ((delta_end**3 - delta_begin**3) / 3)

    def quantization_error(start, end):
        dst_bin_width = bin_width * (end - start + 1) / dst_nbins
        src_bin = np.arange(bins)
        src_bin_begin = (src_bin - start) * bin_width
        src_bin_end = src_bin_begin + bin_width
        dst_of_begin = np.clip(np.floor(src_bin_begin / dst_bin_width), 0, dst_nbins - 1)
        dst_of_end = np.clip(np.floor(src_bin_end / dst_bin_width), 0, dst_nbins - 1)
        density = hist / bin_width
        half = dst_bin_width / 2
        norm = get_norm(src_bin_begin - (dst_of_begin + 0.5) * dst_bin_width, half, density)
        norm = norm + (dst_of_end - dst_of_begin - 1) * get_norm(-half, half, density)
        norm = norm + get_norm(-half, src_bin_end - (dst_of_end * dst_bin_width + half), density)
        return norm.sum()

    a = b = 0
    start, end = 0, bins - 1
    norm_min = np.inf
    while a + b < 100000:
        l, r = start, end
        while l < end and csum[l] < total * ((a + 1) / 100000):
            l += 1
        while r > start and csum[r] > total * (1.0 - (b + 1) / 100000):
            r -= 1
        if l - start > end - r:
            next_start, next_end = l, end
            a += 1
        else:
            next_start, next_end = start, r
            b += 1
        if (next_start, next_end) == (start, end):
            continue
        norm = quantization_error(next_start, next_end)
        if norm > norm_min:
            break
        norm_min, start, end = norm, next_start, next_end
    return edges[start], edges[end + 1]


def ref_moving_average_batches(batches, axis):
    """Mean of per-batch minima and maxima, exactly (Fractions)."""
    chans = [
        np.moveaxis(b, axis, 0).reshape(b.shape[axis], -1) if axis is not None else b.reshape(1, -1)
        for b in batches
    ]
    lo = [
        float(sum(Fraction(float(c[k].min())) for c in chans) / len(chans))
        for k in range(chans[0].shape[0])
    ]
    hi = [
        float(sum(Fraction(float(c[k].max())) for c in chans) / len(chans))
        for k in range(chans[0].shape[0])
    ]
    return np.array(lo), np.array(hi)


REFERENCES = {"max": ref_max, "percentile": ref_percentile, "kl": ref_kl, "mse": ref_mse}


def ref_qparam(name, batches, spec, axis=None):
    if name == "moving_average":
        lo, hi = ref_moving_average_batches(batches, axis)
    else:
        ref = REFERENCES[name]
        if axis is None:
            lo, hi = ref(np.concatenate([b.ravel() for b in batches]), spec)
        else:
            per_channel = [
                ref(np.concatenate([np.take(b, c, axis).ravel() for b in batches]), spec)
                for c in range(batches[0].shape[axis])
            ]
            lo, hi = (np.array(v) for v in zip(*per_channel, strict=True))
    if axis is None:
        lo, hi = np.float64(lo).reshape(()), np.float64(hi).reshape(())
    return QParam.from_range(
        lo, hi, spec.dtype, spec.symmetric, spec.narrow_range, spec.reduce_range, axis
    )


# ---------------------------------------------------------------------------------------
# each calibrator == its reference, on every edge case and spec

NAMES = ["max", "moving_average", "percentile", "kl", "mse"]


@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("data_name", list(DATASETS))
@pytest.mark.parametrize("name", NAMES)
def test_matches_reference(name, data_name, spec_name):
    batches, spec = DATASETS[data_name], SPECS[spec_name]
    got = observe(cal.get(name), batches).compute(spec)
    want = ref_qparam(name, batches, spec)
    assert same(got, want), (got, want, got.rmin, got.rmax, want.rmin, want.rmax)
    assert got.axis is None and got.scale.ndim == 0


@pytest.mark.parametrize("spec_name", ["int8_sym_narrow", "int8_asym"])
@pytest.mark.parametrize("name", NAMES)
def test_per_channel_weights_match_reference(name, spec_name):
    batches, spec = WEIGHTS, SPECS[spec_name]
    got = observe(cal.get(name), batches, axis=0).compute(spec)
    want = ref_qparam(name, batches, spec, axis=0)
    assert same(got, want), (got.rmin, got.rmax, want.rmin, want.rmax)
    assert got.axis == 0 and got.scale.shape == (8,)
    # the pruned channel: degenerate range, scale 1 and the zero point of 0.0
    assert got.rmin[2] == got.rmax[2] == 0 and got.scale[2] == 1


def test_reference_edge_cases_behave_as_explained():
    """The edge-case data really exercises what the comments above say."""
    spec = SPECS["int8_sym_narrow"]
    # single outlier: max keeps 60, percentile and KL clip it. MSE keeps it too: clipping
    # one value from 60 to ~4 costs ~56**2 = 3136 of squared error, more than the finer grid
    # saves on 15000 values (~15000 * (60/256)**2 / 12 = 69); only the empty top bins go.
    out = DATASETS["single_outlier"]
    assert observe(Max(), out).compute(spec).rmax == 60
    for c in (Percentile(), KL()):
        assert observe(c, out).compute(spec).rmax < 10, c
    assert 59 < observe(MSE(), out).compute(spec).rmax < 60
    # all zeros: scale 1 everywhere
    for name in NAMES:
        assert observe(cal.get(name), DATASETS["all_zero"]).compute(spec).scale == 1
    # constant 0.75: no method clips it (percentile takes the upper bin edge, KL keeps
    # the only non-empty bin, MSE's histogram range is empty)
    for name in NAMES:
        assert observe(cal.get(name), DATASETS["constant"]).compute(spec).rmax == np.float32(0.75)
    # negative-only, asymmetric int8: the range is widened to include 0 on the right, so
    # the zero point is qmax
    asym = SPECS["int8_asym"]
    neg = DATASETS["negative_only"]
    for name in NAMES:
        q = observe(cal.get(name), neg).compute(asym)
        assert q.zero_point == 127 and q.rmin < 0, name
        assert q.rmax < 0 or name == "kl", name  # KL records [-T, 0] for non-positive data
    # KL's known degenerate case (NVIDIA's algorithm does the same): |x| >= 0.5 leaves the
    # bins below 0.5 empty, so the candidate whose only non-empty bin is its last one has
    # KL = 0 and wins: T is the upper edge of the first non-empty bin, about min|x|.
    amin = min(float(np.abs(b).min()) for b in neg)
    width = max(float(np.abs(b).max()) for b in neg) / 2048
    q = observe(KL(), neg).compute(asym)
    assert amin <= -q.rmin <= amin + width * 1.0001


# ---------------------------------------------------------------------------------------
# golden numbers, computed by hand


def test_golden_max():
    # [-1, 3] spans 4.0 over 255 steps: scale 4/255, zp = -128 - round(-1 / scale) = -64
    q = observe(Max(), [np.array([-1.0, 0.5], np.float32), np.array([3.0], np.float32)])
    q = q.compute(QuantSpec())
    assert float(q.scale) == np.float32(4 / 255) and int(q.zero_point) == -64


def test_golden_moving_average():
    # batches [-1, 1] and [-3, 5]: mean min -2, mean max 3; int8 asym: scale 5/255,
    # zp = -128 - round(-2 / (5/255)) = -128 + 102 = -26. max would give [-3, 5].
    obs = observe(MovingAverage(), [np.array([-1.0, 1.0]), np.array([-3.0, 0.0, 5.0])])
    q = obs.compute(QuantSpec())
    assert (float(q.rmin), float(q.rmax)) == (-2.0, 3.0)
    assert float(q.scale) == np.float32(5 / 255) and int(q.zero_point) == -26


def test_golden_percentile():
    # |x| = 0..99 in 10 bins of width 9.9: each bin holds 10 values; 90 % of the values are
    # reached at bin 8 = [79.2, 89.1), so T is its upper edge 89.1 (ONNX Runtime / NVIDIA
    # would take the lower edge 79.2). Symmetric narrow int8: scale 89.1 / 127.
    x = np.arange(100, dtype=np.float32)
    q = observe(Percentile(90, bins=10), [x]).compute(SPECS["int8_sym_narrow"])
    assert float(q.rmax) == np.float32(89.1) and float(q.scale) == np.float32(89.1 / 127)
    # asymmetric: upper 89.1 as above; lower: counting from the top, 90 values are reached
    # at bin 1 = [9.9, 19.8), whose lower edge is 9.9 (then widened to include 0)
    q = observe(Percentile(90, bins=10), [x]).compute(SPECS["int8_asym"])
    assert (float(q.rmin), float(q.rmax)) == (np.float32(9.9), np.float32(89.1))
    # percentile 100 is exactly the max range (of x, or of |x| for symmetric specs)
    batches = DATASETS["gaussian"]
    amax = max(float(np.abs(b).max()) for b in batches)
    for spec in SPECS.values():
        got = observe(Percentile(100), batches).compute(spec)
        if spec.symmetric:
            want = QParam.from_range(-amax, amax, spec.dtype, True, spec.narrow_range)
        else:
            want = observe(Max(), batches).compute(spec)
        assert same(got, want)


def test_golden_kl_constant_and_int16():
    # constant 0.75: every i < 2048 folds the outliers onto an empty bin (infinite KL);
    # i = 2048 has KL 0, so T = 0.75
    q = observe(KL(), DATASETS["constant"]).compute(SPECS["int8_sym_narrow"])
    assert float(q.rmax) == 0.75
    # int16 has 32768 levels >= 2048 bins: no clipping can help, T = max|x|
    out = DATASETS["single_outlier"]
    assert float(observe(KL(), out).compute(QuantSpec(dtype="int16", symmetric=True)).rmax) == 60


def test_kl_ties_go_to_the_largest_threshold():
    # mass only in bins 0..2 (equal counts, so h[0] = h[1] changes nothing): every candidate
    # i >= 128 keeps all of it and q = p, so every divergence is 0 (up to float noise);
    # like NVIDIA's "last argmin" the largest i wins, i.e. no clipping
    hist = np.zeros(2048, np.int64)
    hist[:3] = 5
    _, kl = kl_divergences(hist, 128)
    assert np.all(np.abs(kl) < 1e-12)
    assert kl_threshold_bins(hist, 128) == 2048


def test_kl_divergences_match_scipy():
    """Every candidate's divergence, not only the argmin, equals the scipy loop's."""
    for data_name in ("gaussian", "single_outlier", "relu6"):
        values = np.concatenate([b.ravel() for b in DATASETS[data_name]])
        want, _ = ref_kl_divergences(values, 2048, 128)
        a = np.abs(values.astype(np.float64))
        hist, _ = np.histogram(a, bins=2048, range=(0, a.max()))
        i, got = kl_divergences(hist, 128)
        assert i.tolist() == list(want)
        np.testing.assert_allclose(got, list(want.values()), rtol=1e-9, atol=1e-12)


def test_histogram_is_numpy_histogram():
    """The shared vectorized binning == np.histogram per row, including values that sit
    exactly on bin edges and at both ends of the range."""
    rows = np.stack([_gauss(5000).astype(np.float64), np.arange(5000) / 4999 * 3 - 1])
    lo, hi = rows.min(1), rows.max(1)
    edges = np.linspace(lo, hi, 257, axis=-1)
    rows[0, :257] = edges[0]  # every edge value
    got = histogram(rows, edges)
    for c in range(2):
        want, want_edges = np.histogram(rows[c], bins=256, range=(lo[c], hi[c]))
        assert np.array_equal(want_edges, edges[c])
        assert np.array_equal(got[c], want)


def _np_histograms(rows, edges, absolute=False):
    """np.histogram of each row (in float64) over its own edges."""
    out = []
    for r, e in zip(rows.astype(np.float64), edges, strict=True):
        counts, got_edges = np.histogram(
            np.abs(r) if absolute else r, bins=e.size - 1, range=(e[0], e[-1])
        )
        assert np.array_equal(got_edges, e)
        out.append(counts)
    return np.array(out)


def test_float32_binning_at_every_edge():
    """float32 values are binned in float32 against the smallest float32 at or above each
    float64 edge: every float32 just below, at and just above every edge (here 0.7 is not
    a float32: float32(0.7) < 0.7 lies in the bin below it) lands where np.histogram puts
    it, per tensor and per channel, signed and absolute."""
    lo, hi = np.array([-1.3, 0.0]), np.array([2.1, 0.7 * 64])
    edges = np.linspace(lo, hi, 65, axis=-1)
    assert float32_estimate(edges) is not None  # the float32 path is the one tested
    e32 = edges.astype(np.float32)
    rows = np.concatenate([np.nextafter(e32, -np.inf), e32, np.nextafter(e32, np.inf)], 1)
    inside = (rows >= lo[:, None]) & (rows <= hi[:, None])  # (every value is in the range)
    rows = np.where(inside, rows, rows[:, 64:65]).astype(np.float32)
    assert np.array_equal(histogram(rows, edges), _np_histograms(rows, edges))
    assert np.array_equal(histogram(rows[1:], edges[1:]), _np_histograms(rows[1:], edges[1:]))
    a_edges = np.linspace([0.0], [np.abs(rows).max()], 65, axis=-1)
    assert np.array_equal(
        histogram(rows[:1], a_edges, absolute=True), _np_histograms(rows[:1], a_edges, True)
    )


def test_narrow_range_falls_back_to_float64():
    """A range whose start is no float32 and whose bins are narrower than float32's
    spacing there (1000.0001 + 2048 bins of 5e-7; float32 steps by 6e-5 at 1000): the
    float32 estimate could be bins off, so the values are binned in float64, still
    exactly np.histogram."""
    lo = np.array([1000.0001])
    edges = np.linspace(lo, lo + 1e-3, 2049, axis=-1)
    assert float32_estimate(edges) is None
    x = (lo + _rng.uniform(0, 1e-3, (1, 4000))).astype(np.float32)
    x = x[(x >= edges[0, 0]) & (x <= edges[0, -1])][None]
    assert x.size > 1000
    assert np.array_equal(histogram(x, edges), _np_histograms(x, edges))


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.integers(1, 300)),
        elements=st.floats(-1e4, 1e4, width=32),
    ),
    st.integers(1, 3000),
    st.booleans(),
    st.booleans(),
)
def test_float32_binning_is_numpy_histogram(rows, bins, absolute, channels_last):
    """Any float32 rows (a few values or more than the bins; more channels use np.add.at,
    fewer bincount; contiguous or the transposed view of a channels-last batch, as
    ``as_channels`` gives it), any bin count: the same counts as np.histogram in float64."""
    if channels_last:
        rows = np.ascontiguousarray(rows.T).T
    vals = np.abs(rows.astype(np.float64)) if absolute else rows.astype(np.float64)
    lo, hi = vals.min(1), vals.max(1)
    pad = np.where(lo == hi, 0.5, 0.0)
    edges = np.linspace(lo - pad, hi + pad, bins + 1, axis=-1)
    assert np.array_equal(histogram(rows, edges, absolute), _np_histograms(rows, edges, absolute))


def _at_edges(rows, edges, n):
    """``n`` float32 values per row inside the row's range ``[rows.min(), rows.max()]``: the
    float32 just below, nearest to and just above each edge of the row, and its min and max
    (cycled to ``n``)."""
    out = []
    for r, e in zip(rows, edges, strict=True):
        e32 = e.astype(np.float32)
        cand = np.concatenate([np.nextafter(e32, -np.inf), e32, np.nextafter(e32, np.inf)])
        cand = np.concatenate([cand[(cand >= r.min()) & (cand <= r.max())], [r.min(), r.max()]])
        out.append(np.resize(cand, n))
    return np.array(out, np.float32)


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 3), st.integers(1, 300)),
        elements=st.floats(-1e3, 1e3, width=32) | st.sampled_from([0.0, 1.0, 6.0]),
    ),
    st.integers(1, 2048),
    st.integers(1, 600),
    st.booleans(),
)
def test_observer_counts_at_edges_are_numpy_histogram(rows, bins, n, per_channel):
    """The mse observer's counts, per tensor or per channel, over batches whose values sit
    exactly on the bin edges (as float32: rounded down, to nearest and up), at the range's
    min and max, constant rows (repeated values; a constant range is widened as numpy
    does): np.histogram of each row in float64 over the observer's edges, which are
    np.histogram's own."""
    axis = 0 if per_channel else None
    lo, hi = (rows.min(1), rows.max(1)) if per_channel else (rows.min(), rows.max())
    obs = MSE(bins=bins).observer(axis, (lo, hi))
    obs.update(rows[:, :1])  # (one value per row: the edges are fixed on the first batch)
    flat = rows if per_channel else rows.reshape(1, -1)
    batch = _at_edges(flat, obs.edges["signed"], n).reshape((-1, n) if per_channel else -1)
    obs.update(batch)
    obs.update(rows)
    first = rows[:, :1].reshape(flat.shape[0], -1)
    seen = np.concatenate([first, batch.reshape(flat.shape[0], -1), flat], axis=1)
    assert np.array_equal(obs.counts["signed"], _np_histograms(seen, obs.edges["signed"]))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_observer_rejects_nan_and_inf_and_keeps_its_counts(bad):
    """A batch holding NaN or +-Inf is an error (the batch's min/max check) and adds
    nothing; an empty batch adds nothing."""
    x = _gauss(5000)
    obs = MSE().observer(None, (float(x.min()), float(x.max())))
    obs.update(x)
    before = obs.counts["signed"].copy()
    with pytest.raises(ValueError, match="NaN or Inf"):
        obs.update(np.concatenate([x[:100], [bad]]).astype(np.float32))
    obs.update(np.zeros((0, 3), np.float32))
    assert np.array_equal(obs.counts["signed"], before)
    assert np.array_equal(before, _np_histograms(x[None], obs.edges["signed"]))


def scalar_mse_span(hist, width, dst_bins, steps=100_000):
    """One channel's greedy L2 search, one step at a time with ``np.searchsorted`` (the
    sample-by-sample form of ``ref_mse``'s walk on a given histogram; each step's error from
    the one-histogram ``span_errors``)."""
    cum = np.cumsum(hist)
    total = cum[-1]
    a = b = 0
    s, e = 0, hist.size - 1
    best, best_norm = (s, e), np.inf
    while a + b < steps:
        l = min(max(s, int(np.searchsorted(cum, total * ((a + 1) / steps), "left"))), e)
        r = int(np.searchsorted(cum, total * (1.0 - (b + 1) / steps), "right")) - 1
        r = max(min(e, r), s)
        if l - s > e - r:
            s, a = l, a + 1
        elif r < e:
            e, b = r, b + 1
        else:
            if s == e:
                break
            b += 1
            continue
        norm = span_errors(hist, width, [s], [e], dst_bins)[0]
        if norm > best_norm:
            break
        best, best_norm = (s, e), norm
    return best


@st.composite
def histograms(draw):
    """(C, bins) float64 counts: sparse, dense, one dominant bin (long beta runs), all in one
    bin; and a bin width per row."""
    c, bins = draw(st.integers(1, 6)), draw(st.sampled_from([4, 16, 64, 200]))
    kind = draw(st.sampled_from(["sparse", "dense", "spike", "single"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "dense":
        hist = rng.integers(0, 1000, (c, bins))
    elif kind == "sparse":
        hist = rng.integers(0, 3, (c, bins)) * (rng.random((c, bins)) < 0.1)
    else:
        hist = np.zeros((c, bins), np.int64)
        hist[:, rng.integers(0, bins, c)] = rng.integers(1, 10**6, c)
        if kind == "spike":
            hist += rng.integers(0, 2, (c, bins))
    hist[:, rng.integers(0, bins)] += 1  # every row has a value
    # (1e95: bins so wide that only the every-bin error computation is safe from overflow)
    width = rng.uniform(1e-4, 10.0, c) * draw(st.sampled_from([1.0, 1.0, 1.0, 1e95]))
    return hist.astype(np.float64), width


@settings(max_examples=40, deadline=None)
@given(histograms(), st.sampled_from([256, 255, 128, 16]))
def test_mse_spans_match_the_channel_by_channel_walk(hw, dst_bins):
    """All channels walked at once (bisections over the rows, one error row per channel)
    settle on the same spans as each channel on its own, step by step."""
    hist, width = hw
    s, e = mse_spans(hist, width, dst_bins)
    want = [scalar_mse_span(hist[c], width[c], dst_bins) for c in range(hist.shape[0])]
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == want


# ---------------------------------------------------------------------------------------
# properties


CALIBRATORS = [Max(), MovingAverage(), Percentile(99.0, bins=256), KL(bins=512), MSE(bins=256)]
IDS = [c.name for c in CALIBRATORS]

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def batch_lists(draw, min_size=1, max_size=6):
    """(axis, batches): 1-D batches per-tensor, or (C, n) batches with axis 0 or 1."""
    axis = draw(st.sampled_from([None, 0, 1]))
    channels = draw(st.integers(1, 3))
    n = st.integers(1, 30)
    batches = []
    for _ in range(draw(st.integers(min_size, max_size))):
        shape = (draw(n),) if axis is None else (channels, draw(n))
        if axis == 1:
            shape = shape[::-1]
        batches.append(draw(hnp.arrays(np.float32, shape, elements=finite)))
    return axis, batches


def state_size(obs) -> int:
    """How many numbers an observer holds (arrays count their elements)."""
    total = 0
    for v in vars(obs).values():
        if isinstance(v, np.ndarray):
            total += v.size
        elif isinstance(v, list | tuple):
            total += len(v)
        elif isinstance(v, dict):
            total += sum(np.size(x) for x in v.values())
        elif isinstance(v, int | float) and not isinstance(v, bool):
            total += 1
    return total


SPEC_CHOICES = st.builds(
    QuantSpec,
    dtype=st.sampled_from(["int8", "uint8", "int16"]),
    symmetric=st.booleans(),
    narrow_range=st.booleans(),
    reduce_range=st.booleans(),
)

PROPERTY = settings(max_examples=30, deadline=None)


@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=IDS)
@PROPERTY
@given(data=batch_lists(), spec=SPEC_CHOICES, seed=st.randoms(use_true_random=False))
def test_order_insensitive(calibrator, data, spec, seed):
    axis, batches = data
    shuffled = list(batches)
    seed.shuffle(shuffled)
    rng = data_range(batches, axis)
    a = observe(calibrator, batches, axis, rng).compute(spec)
    b = observe(calibrator, shuffled, axis, rng).compute(spec)
    assert same(a, b)


@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=IDS)
@PROPERTY
@given(data=batch_lists(), spec=SPEC_CHOICES, cut=st.integers(0, 6))
def test_merge_equals_single_observer(calibrator, data, spec, cut):
    axis, batches = data
    rng = data_range(batches, axis)  # every shard gets the global range
    single = observe(calibrator, batches, axis, rng).compute(spec)
    left = calibrator.observer(axis, rng if calibrator.needs_range else None)
    right = calibrator.observer(axis, rng if calibrator.needs_range else None)
    for b in batches[:cut]:
        left.update(b)
    for b in batches[cut:]:
        right.update(b)
    left.merge(right)
    assert same(left.compute(spec), single)


@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=IDS)
@PROPERTY
@given(data=batch_lists(min_size=2))
def test_state_does_not_grow_with_batches(calibrator, data):
    axis, batches = data
    rng = data_range(batches, axis)
    few = observe(calibrator, batches, axis, rng)
    many = observe(calibrator, batches * 25, axis, rng)
    few.state(), many.state()  # (histograms bin the batches they keep: see the next test)
    assert state_size(few) == state_size(many) > 0


@PROPERTY
@given(data=batch_lists(min_size=2), bins=st.integers(1, 64))
def test_histogram_keeps_fewer_values_than_a_batch_width(data, bins):
    """A histogram observer keeps short batches to bin them together, fewer than
    ``batch_width(bins)`` values per row (plus the last batch) whatever the number of batches,
    and its counts are np.histogram of every batch so far at any point."""
    axis, batches = data
    rng = data_range(batches, axis)
    obs = MSE(bins=bins).observer(axis, rng)
    seen = []
    for i, b in enumerate(batches * 25):
        obs.update(b)
        seen.append(as_channels(b, axis))
        assert obs.kept < batch_width(bins) + seen[-1].shape[1]
        if i % 7 == 0:
            want = _np_histograms(np.concatenate(seen, axis=1), obs.edges["signed"])
            assert np.array_equal(obs.counts["signed"], want)


@pytest.mark.parametrize("calibrator", CALIBRATORS, ids=IDS)
@PROPERTY
@given(data=batch_lists(), spec=SPEC_CHOICES)
def test_zero_point_in_range_and_symmetric_in_the_middle(calibrator, data, spec):
    axis, batches = data
    q = observe(calibrator, batches, axis).compute(spec)
    qmin, qmax = spec.qrange
    assert np.all((qmin <= q.zero_point) & (q.zero_point <= qmax))
    if spec.symmetric:
        # a non-degenerate symmetric range puts the zero point in the middle; a degenerate
        # one (all zeros, subnormal) gets scale 1 and the zp of 0.0 (0 for uint8, see
        # autoq.primitives.choose_qparams), which only needs to map 0 exactly
        amax = np.maximum(np.abs(q.rmin.astype(np.float64)), np.abs(q.rmax.astype(np.float64)))
        regular = amax / ((qmax - qmin) / 2) >= np.finfo(np.float32).tiny
        assert np.all(np.where(regular, q.zero_point == (qmin + qmax + 1) // 2, True))


# ---------------------------------------------------------------------------------------
# user calibrators, JSON, errors


class _ScaledMaxObserver:
    def __init__(self, factor, axis):
        self.factor, self.axis, self.lo, self.hi = factor, axis, np.inf, -np.inf

    def update(self, x):
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def merge(self, other):
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)

    def compute(self, spec):
        return QParam.from_range(
            self.lo * self.factor,
            self.hi * self.factor,
            spec.dtype,
            spec.symmetric,
            spec.narrow_range,
            spec.reduce_range,
        )


@dataclass(frozen=True)
class ScaledMax:
    """A user-written calibrator: the min/max range times ``factor``."""

    factor: float = 0.5
    name: ClassVar[str] = "scaled_max"
    needs_range: ClassVar[bool] = False

    def observer(self, axis=None, data_range=None):
        return _ScaledMaxObserver(self.factor, axis)


def tenth_range(batch):
    """A user-written range function: a tenth of each batch's range."""
    return float(batch.min()) / 10, float(batch.max()) / 10


def test_user_calibrator_object():
    user = ScaledMax(0.25)
    assert cal.get(user) is user
    batches = DATASETS["gaussian"]
    lo, hi = data_range(batches, None)
    q = observe(cal.get(user), batches).compute(QuantSpec())
    assert q == QParam.from_range(lo * 0.25, hi * 0.25)
    assert cal.from_json(json.loads(json.dumps(cal.to_json(user)))) == user


def test_user_range_function():
    c = cal.get(tenth_range)
    assert isinstance(c, cal.FunctionCalibrator) and not c.needs_range
    batches = DATASETS["gaussian"]
    spec = SPECS["int8_sym_narrow"]
    # per-batch ranges are merged by union
    lo = min(float(b.min()) / 10 for b in batches)
    hi = max(float(b.max()) / 10 for b in batches)
    want = QParam.from_range(lo, hi, "int8", True, True)
    assert observe(c, batches).compute(spec) == want
    # sharded: union of the shards
    left, right = c.observer(), c.observer()
    left.update(batches[0])
    for b in batches[1:]:
        right.update(b)
    left.merge(right)
    assert left.compute(spec) == want
    assert cal.from_json(json.loads(json.dumps(cal.to_json(c)))) == c


@pytest.mark.parametrize(
    "calibrator",
    [
        Max(),
        MovingAverage(),
        Percentile(),
        Percentile(99.9, bins=512),
        Percentile(100),
        KL(),
        KL(bins=4096),
        MSE(),
        MSE(bins=1024),
    ],
    ids=repr,
)
def test_json_round_trip(calibrator):
    d = json.loads(json.dumps(cal.to_json(calibrator)))
    assert d["name"] == calibrator.name
    back = cal.from_json(d)
    assert back == calibrator and type(back) is type(calibrator)
    assert cal.get(calibrator.name) == type(calibrator)()


def test_registry_names():
    assert {"max", "moving_average", "percentile", "kl", "mse"} <= set(cal.REGISTRY)
    for name in NAMES:
        c = cal.get(name)
        assert isinstance(c, cal.Calibrator) and c.name == name
        assert c.needs_range == (name in ("percentile", "kl", "mse"))


@pytest.mark.parametrize(
    "make",
    [
        lambda: Percentile(101),
        lambda: Percentile(10),
        lambda: Percentile(True),
        lambda: KL(bins=0),
        lambda: MSE(bins=2.5),
        lambda: cal.from_json({"name": "percentile", "pct": 99}),
    ],
)
def test_invalid_options(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("name", NAMES)
def test_errors(name):
    c = cal.get(name)
    x = _gauss(100)
    rng = (float(x.min()), float(x.max()))
    obs = c.observer(None, rng if c.needs_range else None)
    with pytest.raises(ValueError, match="no data"):
        obs.compute(QuantSpec())
    with pytest.raises(ValueError, match="NaN or Inf"):
        obs.update(np.array([0.0, np.nan], np.float32))
    obs.update(x)
    obs.update(np.zeros((0,), np.float32))  # empty batches are ignored
    per_channel = c.observer(0, (np.zeros(2), np.ones(2)) if c.needs_range else None)
    per_channel.update(np.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="channel"):
        per_channel.update(np.full((3, 4), 0.5))
    if c.needs_range:
        with pytest.raises(ValueError, match="needs data_range"):
            c.observer(None, None)
        with pytest.raises(ValueError, match="outside the data_range"):
            obs.update(x * 2)
        other = c.observer(None, (rng[0], rng[1] + 1))
        other.update(x)
        with pytest.raises(ValueError, match="different data ranges"):
            obs.merge(other)
    with pytest.raises(TypeError):
        obs.merge(object())
