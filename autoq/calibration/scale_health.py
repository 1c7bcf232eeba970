"""Is every chosen activation scale usable on the data it must represent?

A scale is chosen from statistics (a range, a histogram); one extreme value in one sample
(``1e30`` late in the data, a corrupted image) makes the minmax range so wide that every
ordinary value rounds to the zero point, and the int8 model's output is all zeros. A
hand-edited scale that is far too small clips almost everything. Neither shows up in the
qparams themselves, only against the data: :class:`HealthObserver` counts, over a slot's
calibration values, how many non-zero values land on the zero point (*collapsed*) and how
many fall outside the integer grid (*clipped*), and whether the slot is *constant*.

:func:`problem` turns those counts into a one-line diagnosis (None when the scale is
healthy). The limits are loose on purpose: with minmax on Gaussian data about 1 % of the
values collapse; a 99.99th percentile clips 0.01 %; the defects this catches sit near 100 %.

**Collapsed, but the grid is in use.** A probability map (a sigmoid output: a few percent of
the pixels near 1, the background near 1e-4) also has most of its non-zero values on the
zero point, yet its scale is the right one: what sets the range is not an extreme in one
sample but values spread over the grid in most samples, and the background's rounding
error is below half a step. So the observer also counts (a) the values in each of ``BANDS``
equal bands of the integer grid and (b) the batches (one per sample) that reach a quarter
of the grid away from the zero point; a slot whose values occupy at least
``OCCUPIED_LIMIT`` bands **and** of whose batches at least ``REACHING_LIMIT`` reach that
far is not *collapsed*. The defects fail one or the other: an extreme value in one sample
reaches the grid in one batch; a dead channel with a huge constant bias (every sample)
occupies two bands. PP-OCRv4 det's output sigmoid (40 images, 80 % with text): 96 %
collapsed, 31 of 40 batches reaching, and 16 bands occupied in fp32, but only 7 in the
simulated graph when its logit input has a coarse grid (step 0.98: the sigmoid then takes
a handful of values), so the limit is a quarter of the bands.

Worked example (int8, scale 1, zero point 0; values 0, 0.2, 3, 200)::

    >>> obs = HealthObserver(1.0, 0, -128, 127)
    >>> obs.update(np.array([0.0, 0.2, 3.0, 200.0]))
    >>> h = obs.compute(None)
    >>> h.count, h.nonzero, h.collapsed, h.clipped, h.occupied, h.reaching, h.batches
    (4, 3, 1, 1, 2, 1, 1)
    >>> other = HealthObserver(1.0, 0, -128, 127)
    >>> other.update(np.array([0.4]))
    >>> obs.merge(other)  # shards merge exactly
    >>> obs.compute().collapsed, obs.compute().count
    (2, 5)

(0.2 rounds to the zero point; 200 lies beyond 127; two bands of 16 steps are occupied, the
one of 0, 0.2 and 3 and the last one, which also holds the values beyond the grid; the batch
reaches 64 steps from the zero point.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "BANDS",
    "BAND_SAMPLE",
    "CLIPPED_LIMIT",
    "COLLAPSED_LIMIT",
    "OCCUPIED_LIMIT",
    "REACHING_LIMIT",
    "HealthCheck",
    "HealthObserver",
    "SlotHealth",
    "collapse_cause",
    "problem",
]

#: more than this fraction of a slot's non-zero values rounding to the zero point: unusable
COLLAPSED_LIMIT = 0.5
#: more than this fraction of a slot's values outside the integer grid: unusable
CLIPPED_LIMIT = 0.25
#: the integer grid cut into this many equal bands (values beyond it count in the end bands)
BANDS = 16
#: a batch of more values counts its bands on every k-th value (at most this many): a
#: subset occupies no more bands than the whole, so sampling can only withhold the
#: exemption, never grant it; the other counts see every value
BAND_SAMPLE = 65536
#: values in at least this many bands: the scale is used by the data, collapsed or not
OCCUPIED_LIMIT = BANDS // 4
#: ... and at least this fraction of the batches reach a quarter of the grid from the zero point
REACHING_LIMIT = 0.5


@dataclass(frozen=True)
class SlotHealth:
    """Counts over one slot's calibration values (see the module docstring)."""

    count: int
    nonzero: int
    collapsed: int
    clipped: int
    lo: float
    hi: float
    #: bands of the integer grid holding at least one value (see the module docstring)
    occupied: int = 0
    #: batches reaching a quarter of the grid from the zero point, of ``batches``
    reaching: int = 0
    batches: int = 0

    @property
    def grid_used(self) -> bool:
        """The values spread over the grid in most batches (module docstring)."""
        return self.occupied >= OCCUPIED_LIMIT and self.reaching >= REACHING_LIMIT * self.batches

    @property
    def constant(self) -> bool:
        return self.count > 0 and self.lo == self.hi

    def to_json(self) -> dict:
        return {
            "count": self.count,
            "nonzero": self.nonzero,
            "collapsed": self.collapsed,
            "clipped": self.clipped,
            "range": [self.lo, self.hi],
            "occupied": self.occupied,
            "reaching": [self.reaching, self.batches],
        }


class HealthObserver:
    """Streaming :class:`SlotHealth` of one slot for a given per-tensor scale and zero
    point (mergeable across shards, like every observer)."""

    def __init__(self, scale, zero_point, qmin: int, qmax: int, axis: int | None = None):
        s = np.asarray(scale, np.float64).reshape(-1)
        z = np.asarray(zero_point, np.int64).reshape(-1)
        #: per-channel grids (``axis``, a depthwise input): each channel is counted on its
        #: own grid, its values measured in steps of its own scale (the thresholds below
        #: then have scale 1 and one zero point per channel)
        self.axis = axis if s.size > 1 else None
        self.channel_scale = s.astype(np.float32) if self.axis is not None else None
        self.scale = 1.0 if self.axis is not None else float(s[0])
        self.zero_point = z if self.axis is not None else int(z[0])
        self.qmin, self.qmax = qmin, qmax
        # rint(x / s) + zp is the zero point iff |x| <= s / 2, below the grid iff
        # x < (qmin - zp - 1/2) s, above it iff x > (qmax - zp + 1/2) s: thresholds, so an
        # update is a few passes of comparisons in the data's own dtype (no float64 copy,
        # no division; it runs on every activation of every calibration sample).
        self.half = 0.5 * self.scale
        self.below = (qmin - self.zero_point - 0.5) * self.scale
        self.above = (qmax - self.zero_point + 0.5) * self.scale
        self.counts = np.zeros(4, np.int64)  # count, nonzero, collapsed, clipped
        # band k of the grid: [below + k w, below + (k + 1) w), w = (qmax - qmin + 1) s / BANDS
        self.band_scale = BANDS / ((qmax - qmin + 1) * self.scale)
        self.bands = np.zeros(BANDS, np.int64)
        self.far = 0.25 * (qmax - qmin + 1) * self.scale  # a quarter of the grid
        self.batches = np.zeros(2, np.int64)  # batches, of them reaching ``far``
        self.lo, self.hi = np.inf, -np.inf

    def update(self, x: np.ndarray) -> None:
        """Count ``x`` (exact up to values within one ulp of a rounding boundary, where
        the comparison in ``x``'s dtype and ``rint`` of the quotient may disagree)."""
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float64)
        if not x.size:
            return
        real = (float(x.min()), float(x.max()))
        lo, hi = real
        below, above = self.below, self.above
        if self.axis is not None:  # in steps of each channel's scale
            shape = [1] * x.ndim
            shape[self.axis] = -1
            x = x / self.channel_scale.reshape(shape).astype(x.dtype)
            below, above = below.reshape(shape), above.reshape(shape)
            lo, hi = float(x.min()), float(x.max())
        zeros = int(np.count_nonzero(x == 0))  # (count_nonzero of floats is 4x slower)
        near_zero = self._near_zero(x.reshape(-1), lo)  # zeros included
        clipped = int(np.count_nonzero(x < below)) if lo < np.min(below) else 0
        clipped += int(np.count_nonzero(x > above)) if hi > np.max(above) else 0
        self.counts += (x.size, x.size - zeros, near_zero - zeros, clipped)
        step = -(-x.size // BAND_SAMPLE)  # bands from a regular sample of a large batch
        finite = np.isfinite(lo) and np.isfinite(hi)
        if self.axis is not None:  # positions on each channel's grid, then the sample
            pos = np.subtract(x, below, dtype=x.dtype).reshape(-1)[::step]
            self.bands += self._band_counts(pos, 0.0, finite)
        else:
            self.bands += self._band_counts(x.reshape(-1)[::step], self.below, finite)
        self.batches += (1, max(-lo, hi) >= self.far)
        self.lo = min(self.lo, real[0])
        self.hi = max(self.hi, real[1])

    def _near_zero(self, x: np.ndarray, lo: float) -> int:
        """How many values of ``x`` satisfy ``|x| <= half`` (``half`` rounded to ``x``'s
        dtype, like a comparison with the Python float): those ``<= half`` less those
        ``< -half``, a count skipped when the minimum ``lo`` is not below it (after a relu:
        one comparison pass instead of ``abs`` and a comparison)."""
        half = x.dtype.type(self.half)
        n = int(np.count_nonzero(x <= half))
        return n - int(np.count_nonzero(x < -half)) if not lo >= -half else n

    def _band_counts(self, x: np.ndarray, below, finite: bool = True) -> np.ndarray:
        """Values per band, positions computed in ``x``'s dtype in one buffer (an overflow
        to inf lands in the last band; a value on a band edge may land on either side: bands
        are a coarse count, not the rounding). ``finite``: ``x`` holds no nan/inf (the
        common case skips ``nan_to_num``, which made this count 7x slower than the rest of
        :meth:`update` on a ResNet-50 activation). ``below``: the grid's lower edge (0 when
        ``x`` already holds positions from it)."""
        pos = np.subtract(x, below, dtype=x.dtype)  # no float64 copy of x
        pos *= self.band_scale
        if not finite:
            np.nan_to_num(pos, copy=False, nan=0.0, posinf=BANDS - 1, neginf=0.0)
        np.clip(pos, 0, BANDS - 1, out=pos)
        return np.bincount(pos.astype(np.uint8), minlength=BANDS)[:BANDS]

    def merge(self, other: HealthObserver) -> None:
        self.merge_state(other.state())

    def state(self) -> dict[str, np.ndarray]:
        return {
            "counts": self.counts.copy(),
            "range": np.array([self.lo, self.hi]),
            "bands": self.bands.copy(),
            "batches": self.batches.copy(),
        }

    def merge_state(self, state: dict[str, np.ndarray]) -> None:
        self.counts += np.asarray(state["counts"], np.int64)
        self.bands += np.asarray(state["bands"], np.int64)
        self.batches += np.asarray(state["batches"], np.int64)
        lo, hi = (float(v) for v in state["range"])
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)

    def compute(self, spec=None) -> SlotHealth:
        n, nz, col, clip = (int(v) for v in self.counts)
        occupied = int(np.count_nonzero(self.bands))
        batches, reaching = (int(v) for v in self.batches)
        return SlotHealth(n, nz, col, clip, self.lo, self.hi, occupied, reaching, batches)


@dataclass(frozen=True)
class HealthCheck:
    """Calibrator-shaped factory of :class:`HealthObserver` for one slot's qparams (so a
    shard runner can observe it like any calibrator)."""

    qparam: object  # autoq.qparams.QParam
    needs_range = False

    def observer(self, axis=None, data_range=None) -> HealthObserver:
        """A per-axis qparam (a lookup or depthwise input per channel) is checked on each
        channel's own grid: a value collapses when it rounds to its channel's zero point,
        clips outside its channel's grid (a grid covering every channel would call a
        channel of small values collapsed that its own grid represents well).

        >>> from autoq.qparams import QParam
        >>> qp = QParam.from_range(np.zeros(2), np.array([0.1, 10.0]), "uint8", axis=1)
        >>> obs = HealthCheck(qp).observer()
        >>> obs.update(np.array([[0.05, 0.08], [5.0, 9.0]]).reshape(1, 2, 2))
        >>> h = obs.compute()
        >>> h.collapsed, h.clipped, (h.lo, h.hi)
        (0, 0, (0.05, 9.0))
        """
        qp = self.qparam
        return HealthObserver(qp.scale, qp.zero_point, qp.qmin, qp.qmax, qp.axis)


def problem(h: SlotHealth, scale: float, bounded: bool = False) -> str | None:
    """Why the scale is unusable on these values, or None; the text names the cause the
    counts point to (:func:`collapse_cause`).

    >>> problem(SlotHealth(100, 100, 99, 0, -1.0, 1e30, 16, 1, 10), 3.9e27)
    '99% of its non-zero values round to the zero point (range [-1, 1e+30], scale 3.9e+27): the range is set by the values of 1 of 10 samples (an extreme value? remove it from the data or use a percentile calibrator)'
    >>> problem(SlotHealth(100, 100, 1, 0, -1.0, 1.0), 0.0078) is None
    True

    A probability map: 96 % collapsed, but its values occupy all 16 bands of the grid and
    32 of its 40 samples reach a quarter of it:

    >>> problem(SlotHealth(1000, 1000, 960, 0, 1e-5, 1.0, 16, 32, 40), 1 / 255) is None
    True

    ``bounded``: the slot is the output of a bounded lookup (a class-score sigmoid,
    :func:`autoq.rules.lut_ranges.bounded_lut_outputs`) on a grid inside the activation's
    output range. Nothing can widen that grid, so a value on the zero point is within half
    a step of at most ``1 / 255`` of it: collapse is the data (nearly every anchor's score
    near 0), not a defect. Clipping is still one:

    >>> scores = SlotHealth(1000, 1000, 990, 0, 1e-8, 0.8, 14, 12, 32)
    >>> problem(scores, 0.8 / 255).split(": ")[-1]
    'nearly all its values lie near zero and only 12 of 32 samples reach a quarter of the grid (a sparse score or probability map?)'
    >>> problem(scores, 0.8 / 255, bounded=True) is None
    True
    """
    where = f"range [{h.lo:.3g}, {h.hi:.3g}], scale {scale:.3g}"
    collapsed = h.nonzero and h.collapsed > COLLAPSED_LIMIT * h.nonzero and not h.grid_used
    if collapsed and not bounded:
        return (
            f"{100 * h.collapsed // h.nonzero}% of its non-zero values round to the zero point "
            f"({where}): {collapse_cause(h)}"
        )
    if h.count and h.clipped > CLIPPED_LIMIT * h.count:
        return f"{100 * h.clipped // h.count}% of its values fall outside the int8 grid ({where})"
    return None


def collapse_cause(h: SlotHealth) -> str:
    """What the counts of a collapsed slot say set its range: few samples reach the grid
    (an extreme value), few bands hold values (a distant constant), or neither: the values
    sit near zero in every sample and the grid's far end is reached in too few of them.

    >>> collapse_cause(SlotHealth(100, 100, 99, 0, 0.0, 9.0, 2, 10, 10))
    'its values occupy 2 of the 16 bands of the grid (a few distant values in every sample: a channel with a large constant bias?)'
    >>> collapse_cause(SlotHealth(100, 100, 99, 0, 0.0, 9.0, 12, 3, 10))
    'nearly all its values lie near zero and only 3 of 10 samples reach a quarter of the grid (a sparse score or probability map?)'
    """
    if h.reaching <= 1 < h.batches:
        return (
            f"the range is set by the values of {h.reaching} of {h.batches} samples (an extreme "
            "value? remove it from the data or use a percentile calibrator)"
        )
    if h.occupied < OCCUPIED_LIMIT:
        return (
            f"its values occupy {h.occupied} of the {BANDS} bands of the grid (a few distant "
            "values in every sample: a channel with a large constant bias?)"
        )
    return (
        f"nearly all its values lie near zero and only {h.reaching} of {h.batches} samples "
        "reach a quarter of the grid (a sparse score or probability map?)"
    )
