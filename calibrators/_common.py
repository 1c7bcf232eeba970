"""Helpers shared by the calibrator modules (not a calibrator: the name starts with ``_``).

* :func:`as_channels` views a batch as ``(C, M)``: one row per channel (``C = 1`` per-tensor);
* :func:`batch_minmax` is the per-row min and max of a batch, checked to be finite;
* :func:`range_qparam` turns a chosen real range into a :class:`QParam` for a ``QuantSpec``;
* :class:`AxisCalibrator` is the base of the calibrators without options whose observer
  needs only the axis (``max``, ``moving_average``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from autoq.qparams import QParam

__all__ = ["AxisCalibrator", "as_channels", "batch_minmax", "no_data", "range_qparam"]


def as_channels(x, axis: int | None) -> np.ndarray:
    """``x`` as a 2-D array ``(C, M)``: row ``c`` holds every element of channel ``c``
    (all dimensions but ``axis``); per-tensor (``axis=None``) gives a single row."""
    x = np.asarray(x)
    if x.dtype.kind not in "fiub":
        raise TypeError(f"calibration data must be a real numeric array, got dtype {x.dtype}")
    if axis is None:
        return x.reshape(1, -1)
    if x.ndim == 0:
        raise ValueError(f"per-channel statistics (axis={axis}) need an array, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for a batch of shape {x.shape}")
    return np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)


def batch_minmax(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (min, max) as float64 arrays of shape ``(C,)``; NaN or Inf is an error."""
    lo = rows.min(axis=1).astype(np.float64)
    hi = rows.max(axis=1).astype(np.float64)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise ValueError("calibration batch contains NaN or Inf")
    return lo, hi


def no_data() -> ValueError:
    return ValueError("no data was observed: call update() with at least one non-empty batch")


def range_qparam(rmin, rmax, spec, axis: int | None) -> QParam:
    """The QParam of ``spec`` for the real range ``[rmin, rmax]`` (arrays of shape ``(C,)``;
    per-tensor when ``axis`` is None)."""
    rmin = np.asarray(rmin, np.float64)
    rmax = np.asarray(rmax, np.float64)
    if axis is None:
        rmin, rmax = rmin.reshape(()), rmax.reshape(())
    return QParam.from_range(
        rmin, rmax, spec.dtype, spec.symmetric, spec.narrow_range, spec.reduce_range, axis
    )


class AxisCalibrator:
    """Base of a calibrator without options (a frozen dataclass without fields) whose
    observer, ``observer_type(axis)``, needs no data range."""

    name: ClassVar[str]
    needs_range: ClassVar[bool] = False
    observer_type: ClassVar[type]

    def observer(self, axis: int | None = None, data_range=None):
        return self.observer_type(axis)
