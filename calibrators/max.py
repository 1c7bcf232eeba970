"""``max``: the global minimum and maximum of everything observed.

Per-tensor (``axis=None``): one range for the whole tensor. Per-channel (``axis=k``, the
default for weights): one range per index of dimension ``k``, reduced over all other
dimensions. The range goes to :meth:`autoq.qparams.QParam.from_range` with the spec's
dtype / symmetric / narrow_range / reduce_range.

Same as ONNX Runtime's ``MinMax`` (without ``moving_average``), TensorRT's max calibration and
torch's ``MinMaxObserver`` / ``PerChannelMinMaxObserver``. min and max are exact and
associative, so the result never depends on batch order or sharding. State: two numbers
per channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import register
from ._common import AxisCalibrator, as_channels, batch_minmax, no_data, range_qparam


class MaxObserver:
    """Running per-channel minimum and maximum."""

    def __init__(self, axis: int | None) -> None:
        self.axis = axis
        self.lo: np.ndarray | None = None  # float64, shape (C,)
        self.hi: np.ndarray | None = None

    def _absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        if self.lo is None:
            self.lo, self.hi = lo, hi
            return
        if lo.shape != self.lo.shape:
            raise ValueError(f"channel count changed from {self.lo.size} to {lo.size}")
        self.lo = np.minimum(self.lo, lo)
        self.hi = np.maximum(self.hi, hi)

    def update(self, x) -> None:
        rows = as_channels(x, self.axis)
        if rows.size == 0:
            return
        self._absorb(*batch_minmax(rows))

    def merge(self, other: MaxObserver) -> None:
        if not isinstance(other, MaxObserver) or other.axis != self.axis:
            raise TypeError("can only merge a MaxObserver with the same axis")
        if other.lo is not None:
            self._absorb(other.lo, other.hi)

    def compute(self, spec):
        if self.lo is None:
            raise no_data()
        return range_qparam(self.lo, self.hi, spec, self.axis)


@register("max")
@dataclass(frozen=True)
class Max(AxisCalibrator):
    """Global min/max (no options)."""

    observer_type: ClassVar[type] = MaxObserver
