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
from ._common import AxisCalibrator, MaxObserver


@register("max")
@dataclass(frozen=True)
class Max(AxisCalibrator):
    """Global min/max (no options)."""

    observer_type: ClassVar[type] = MaxObserver
