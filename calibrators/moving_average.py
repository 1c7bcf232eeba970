"""``moving_average``: the mean of the per-batch minima and the mean of the per-batch maxima.

Each ``update(x)`` takes the minimum and maximum of that batch (per channel when ``axis`` is
given); ``compute`` uses ``[mean of the minima, mean of the maxima]``. Averaging damps
rare extreme batches, so the range is tighter than ``max`` when outliers come and go.
"Per batch" means per call to ``update``: the result depends on how the driver batches
the data (as it does in ONNX Runtime), not on the order of the batches.

Why not an EMA. ONNX Runtime's ``MinMax(moving_average=True)`` (and torch's
``MovingAverageMinMaxObserver``) keep an exponential moving average
``m <- m + 0.01 * (batch_value - m)``, seeded by the first batch: the result depends on the
order of the batches (late batches weigh more, the first one most), and two shards cannot
be combined into what one observer would have computed. The plain mean is the value the EMA
estimates for stationary data, and it is a sum and a count, so it is order-insensitive and
``merge`` is exact.

Exactness. The sums are kept as Python integers in units of 2**-1074 (every finite double is
an integer multiple of it), so addition is exact and associative: shuffled batches and
merged shards give bit-identical results, and the mean is the correctly rounded quotient.
State: two integers per channel and a count (the integers grow by one bit each time the
number of batches doubles, i.e. logarithmically, never with the data).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import numpy as np

from . import register
from ._common import AxisCalibrator, as_channels, batch_minmax, no_data, range_qparam

_SHIFT = 1074  # 2**-1074 is the smallest positive double: every double is k * 2**-1074


def _exact(v: float) -> int:
    """``v * 2**1074`` as an exact integer."""
    num, den = float(v).as_integer_ratio()
    return num << (_SHIFT - (den.bit_length() - 1))


def _mean(total: int, count: int) -> float:
    return float(Fraction(total, count << _SHIFT))


class MovingAverageObserver:
    """Exact sums of per-batch minima and maxima, and the number of batches."""

    def __init__(self, axis: int | None) -> None:
        self.axis = axis
        self.sum_lo: list[int] = []
        self.sum_hi: list[int] = []
        self.count = 0

    def _absorb(self, sum_lo: list[int], sum_hi: list[int], count: int) -> None:
        if self.count == 0:
            self.sum_lo, self.sum_hi = list(sum_lo), list(sum_hi)
        elif len(sum_lo) != len(self.sum_lo):
            raise ValueError(f"channel count changed from {len(self.sum_lo)} to {len(sum_lo)}")
        else:
            self.sum_lo = [a + b for a, b in zip(self.sum_lo, sum_lo, strict=True)]
            self.sum_hi = [a + b for a, b in zip(self.sum_hi, sum_hi, strict=True)]
        self.count += count

    def update(self, x) -> None:
        rows = as_channels(x, self.axis)
        if rows.size == 0:
            return
        lo, hi = batch_minmax(rows)
        self._absorb([_exact(v) for v in lo], [_exact(v) for v in hi], 1)

    def merge(self, other: MovingAverageObserver) -> None:
        if not isinstance(other, MovingAverageObserver) or other.axis != self.axis:
            raise TypeError("can only merge a MovingAverageObserver with the same axis")
        if other.count:
            self._absorb(other.sum_lo, other.sum_hi, other.count)

    def compute(self, spec):
        if self.count == 0:
            raise no_data()
        lo = np.array([_mean(s, self.count) for s in self.sum_lo])
        hi = np.array([_mean(s, self.count) for s in self.sum_hi])
        return range_qparam(lo, hi, spec, self.axis)


@register("moving_average")
@dataclass(frozen=True)
class MovingAverage(AxisCalibrator):
    """Mean of per-batch min and max (no options)."""

    observer_type: ClassVar[type] = MovingAverageObserver
