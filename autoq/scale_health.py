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

Worked example (int8, scale 1, zero point 0; values 0, 0.2, 3, 200)::

    >>> obs = HealthObserver(1.0, 0, -128, 127)
    >>> obs.update(np.array([0.0, 0.2, 3.0, 200.0]))
    >>> h = obs.compute(None)
    >>> h.count, h.nonzero, h.collapsed, h.clipped
    (4, 3, 1, 1)
    >>> other = HealthObserver(1.0, 0, -128, 127)
    >>> other.update(np.array([0.4]))
    >>> obs.merge(other)  # shards merge exactly
    >>> obs.compute().collapsed, obs.compute().count
    (2, 5)

(0.2 rounds to the zero point; 200 lies beyond 127.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "CLIPPED_LIMIT",
    "COLLAPSED_LIMIT",
    "HealthCheck",
    "HealthObserver",
    "SlotHealth",
    "problem",
]

#: more than this fraction of a slot's non-zero values rounding to the zero point: unusable
COLLAPSED_LIMIT = 0.5
#: more than this fraction of a slot's values outside the integer grid: unusable
CLIPPED_LIMIT = 0.25


@dataclass(frozen=True)
class SlotHealth:
    """Counts over one slot's calibration values (see the module docstring)."""

    count: int
    nonzero: int
    collapsed: int
    clipped: int
    lo: float
    hi: float

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
        }


class HealthObserver:
    """Streaming :class:`SlotHealth` of one slot for a given per-tensor scale and zero
    point (mergeable across shards, like every observer)."""

    def __init__(self, scale, zero_point, qmin: int, qmax: int):
        self.scale = float(np.asarray(scale).reshape(-1)[0])
        self.zero_point = int(np.asarray(zero_point).reshape(-1)[0])
        self.qmin, self.qmax = qmin, qmax
        # rint(x / s) + zp is the zero point iff |x| <= s / 2, below the grid iff
        # x < (qmin - zp - 1/2) s, above it iff x > (qmax - zp + 1/2) s: thresholds, so an
        # update is a few passes of comparisons in the data's own dtype (no float64 copy,
        # no division; it runs on every activation of every calibration sample).
        self.half = 0.5 * self.scale
        self.below = (qmin - self.zero_point - 0.5) * self.scale
        self.above = (qmax - self.zero_point + 0.5) * self.scale
        self.counts = np.zeros(4, np.int64)  # count, nonzero, collapsed, clipped
        self.lo, self.hi = np.inf, -np.inf

    def update(self, x: np.ndarray) -> None:
        """Count ``x`` (exact up to values within one ulp of a rounding boundary, where
        the comparison in ``x``'s dtype and ``rint`` of the quotient may disagree)."""
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float64)
        x = x.reshape(-1)
        if not x.size:
            return
        lo, hi = float(x.min()), float(x.max())
        nonzero = int(np.count_nonzero(x))
        near_zero = int(np.count_nonzero(np.abs(x) <= self.half))  # zeros included
        clipped = int(np.count_nonzero(x < self.below)) if lo < self.below else 0
        clipped += int(np.count_nonzero(x > self.above)) if hi > self.above else 0
        self.counts += (x.size, nonzero, near_zero - (x.size - nonzero), clipped)
        self.lo = min(self.lo, lo)
        self.hi = max(self.hi, hi)

    def merge(self, other: HealthObserver) -> None:
        self.merge_state(other.state())

    def state(self) -> dict[str, np.ndarray]:
        return {"counts": self.counts.copy(), "range": np.array([self.lo, self.hi])}

    def merge_state(self, state: dict[str, np.ndarray]) -> None:
        self.counts += np.asarray(state["counts"], np.int64)
        lo, hi = (float(v) for v in state["range"])
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)

    def compute(self, spec=None) -> SlotHealth:
        n, nz, col, clip = (int(v) for v in self.counts)
        return SlotHealth(n, nz, col, clip, self.lo, self.hi)


@dataclass(frozen=True)
class HealthCheck:
    """Calibrator-shaped factory of :class:`HealthObserver` for one slot's qparams (so a
    shard runner can observe it like any calibrator)."""

    qparam: object  # autoq.qparams.QParam
    needs_range = False

    def observer(self, axis=None, data_range=None) -> HealthObserver:
        qp = self.qparam
        return HealthObserver(qp.scale, qp.zero_point, qp.qmin, qp.qmax)


def problem(h: SlotHealth, scale: float) -> str | None:
    """Why the scale is unusable on these values, or None.

    >>> problem(SlotHealth(100, 100, 99, 0, -1.0, 1e30), 3.9e27)
    '99% of its non-zero values round to the zero point (range [-1, 1e+30], scale 3.9e+27)'
    >>> problem(SlotHealth(100, 100, 1, 0, -1.0, 1.0), 0.0078) is None
    True
    """
    where = f"range [{h.lo:.3g}, {h.hi:.3g}], scale {scale:.3g}"
    if h.nonzero and h.collapsed > COLLAPSED_LIMIT * h.nonzero:
        return f"{100 * h.collapsed // h.nonzero}% of its non-zero values round to the zero point ({where})"
    if h.count and h.clipped > CLIPPED_LIMIT * h.count:
        return f"{100 * h.clipped // h.count}% of its values fall outside the int8 grid ({where})"
    return None
