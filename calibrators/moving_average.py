"""``moving_average``: the mean of the per-batch minima and the mean of the per-batch maxima.

Each ``update(x)`` takes the minimum and maximum of that batch (per channel when ``axis`` is
given); ``compute`` uses ``[mean of the minima, mean of the maxima]``. Averaging damps
rare extreme batches, so the range is tighter than ``max`` when outliers come and go.
"Per batch" means per call to ``update``: the result depends on how the driver batches
the data (as it does in ONNX Runtime), not on the order of the batches nor on how the
batches are split into shards. The batching is part of the method's definition (a batch of
32 images has a wider range than each image); autoq's calibrate driver makes one batch per
dataset sample, in-process and distributed alike, so sharding the samples never changes it.

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
number of batches doubles, i.e. logarithmically, never with the data). :meth:`state` writes
the integers as little-endian two's complement bytes, one ``uint8`` row per channel (at most
~270 bytes: 2**-1074 to 2**1024 plus the count's bits), so it crosses process boundaries
as plain numpy and merges exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import numpy as np

from . import register
from ._common import AxisCalibrator, as_channels, batch_minmax, check_state, no_data, range_qparam

_SHIFT = 1074  # 2**-1074 is the smallest positive double: every double is k * 2**-1074


def _exact(v: float) -> int:
    """``v * 2**1074`` as an exact integer."""
    num, den = float(v).as_integer_ratio()
    return num << (_SHIFT - (den.bit_length() - 1))


def _mean(total: int, count: int) -> float:
    return float(Fraction(total, count << _SHIFT))


def to_bytes(values: list[int]) -> np.ndarray:
    """Integers as a ``(len, width)`` uint8 array of little-endian two's complement rows.

    >>> to_bytes([1, -2, 256]).tolist()
    [[1, 0], [254, 255], [0, 1]]
    >>> from_bytes(to_bytes([1, -2, 256]))
    [1, -2, 256]
    """
    width = max([1] + [(v.bit_length() + 8) // 8 for v in values])  # + 1 sign bit
    raw = b"".join(v.to_bytes(width, "little", signed=True) for v in values)
    return np.frombuffer(raw, np.uint8).reshape(len(values), width).copy()


def from_bytes(rows: np.ndarray) -> list[int]:
    """The inverse of :func:`to_bytes`."""
    return [int.from_bytes(r.tobytes(), "little", signed=True) for r in rows.astype(np.uint8)]


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
        self.merge_state(other.state())

    def state(self) -> dict[str, np.ndarray]:
        """``{"count": int64 (), "sum_lo", "sum_hi": uint8 (C, width)}`` (see the module
        docstring); ``C = 0`` before any data."""
        return {
            "count": np.array(self.count, np.int64),
            "sum_lo": to_bytes(self.sum_lo),
            "sum_hi": to_bytes(self.sum_hi),
        }

    def merge_state(self, state: dict[str, np.ndarray]) -> None:
        state = check_state(self, state, ("count", "sum_lo", "sum_hi"))
        count = int(state["count"])
        if count:
            self._absorb(from_bytes(state["sum_lo"]), from_bytes(state["sum_hi"]), count)

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
