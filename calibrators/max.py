"""``max``: the global minimum and maximum of everything observed.

Per-tensor (``axis=None``): one range for the whole tensor. Per-channel (``axis=k``, the
default for weights): one range per index of dimension ``k``, reduced over all other
dimensions. The range goes to :meth:`autoq.qparams.QParam.from_range` with the spec's
dtype / symmetric / narrow_range / reduce_range.

Same as ONNX Runtime's ``MinMax`` (without ``moving_average``), TensorRT's max calibration and
torch's ``MinMaxObserver`` / ``PerChannelMinMaxObserver``. min and max are exact and
associative, so the result never depends on batch order, batching or sharding. State
(:meth:`MaxObserver.state`): ``{"lo", "hi"}``, two float64 per channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from . import register
from ._common import MinMaxState, as_channels, batch_minmax, no_data, range_qparam


class MaxObserver(MinMaxState):
    """Running per-channel minimum and maximum (also the range pass of the histogram
    calibrators: see :func:`autoq.calibrators.range_observer`)."""

    def __init__(self, axis: int | None) -> None:
        self.axis = axis

    def update(self, x) -> None:
        rows = as_channels(x, self.axis)
        if rows.size == 0:
            return
        self.absorb(*batch_minmax(rows))

    def merge(self, other: MaxObserver) -> None:
        if not isinstance(other, MaxObserver) or other.axis != self.axis:
            raise TypeError("can only merge a MaxObserver with the same axis")
        self.merge_state(other.state())

    def data_range(self) -> tuple:
        """``(lo, hi)``: float64 scalars per-tensor, ``(C,)`` arrays per-channel; the
        ``data_range`` a histogram calibrator's observer is created with."""
        if self.lo is None:
            raise no_data()
        if self.axis is None:
            return self.lo[0], self.hi[0]
        return self.lo.copy(), self.hi.copy()

    def compute(self, spec):
        if self.lo is None:
            raise no_data()
        return range_qparam(self.lo, self.hi, spec, self.axis)


@register("max")
@dataclass(frozen=True)
class Max:
    """Global min/max (no options)."""

    name: ClassVar[str]
    needs_range: ClassVar[bool] = False

    def observer(self, axis: int | None = None, data_range=None) -> MaxObserver:
        return MaxObserver(axis)
