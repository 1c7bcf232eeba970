"""Helpers shared by the calibrator modules (not a calibrator: the name starts with ``_``).

* :func:`as_channels` views a batch as ``(C, M)``: one row per channel (``C = 1`` per-tensor);
* :func:`batch_minmax` is the per-row min and max of a batch, checked to be finite;
* :func:`range_qparam` turns a chosen real range into a :class:`QParam` for a ``QuantSpec``;
* :func:`check_state` validates a state received from another observer (another process);
* :class:`MinMaxState` is the running per-channel (min, max) and its state, shared by the
  ``max`` observer, the range pass of histogram calibrators and user range functions.
* :class:`MaxObserver` is the ``max`` calibrator's observer and the range pass of the
  histogram calibrators;
* :class:`AxisCalibrator` is the base of the calibrators without options whose observer
  needs only the axis (``max``, ``moving_average``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from autoq.qparams import QParam

__all__ = [
    "AxisCalibrator",
    "MaxObserver",
    "MinMaxState",
    "as_channels",
    "batch_minmax",
    "check_state",
    "no_data",
    "range_qparam",
]


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
    """Per-row (min, max) as float64 arrays of shape ``(C,)``; NaN or Inf is an error.

    A zero extreme is always ``+0.0``: ``min(-0.0, 0.0)`` is either, depending on the
    order the values are met in, and the sign would leak into the recorded range and the
    histogram edges (``-0.0 + 0.0 == +0.0``).

    >>> batch_minmax(np.array([[0.0, -0.0, 2.0]]))
    (array([0.]), array([2.]))
    """
    lo = rows.min(axis=1).astype(np.float64) + 0.0
    hi = rows.max(axis=1).astype(np.float64) + 0.0
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


def check_state(observer, state, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``state`` as a dict of the numpy arrays ``keys``, or a clear error: a state is plain
    numeric numpy (it crosses process boundaries), made by an observer of the same kind."""
    name = type(observer).__name__
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{name}.merge_state: expected a state with the arrays {sorted(keys)}, got {got} "
            "(a state from another calibrator or another autoq version?)"
        )
    for k in keys:
        v = state[k]
        if not isinstance(v, np.ndarray) or v.dtype.kind not in "iuf":
            raise TypeError(f"{name}.merge_state: state[{k!r}] must be a numeric numpy array")
    return state


class MinMaxState:
    """Running per-channel ``lo``/``hi`` (float64 arrays, None before any data).

    min and max are exact and associative, so :meth:`state` (``{"lo", "hi"}``, size 0 when
    empty) merges into any other observer of the same kind with the same result whatever
    the split of the batches into shards and the order of merging.

    >>> a, b = MinMaxState(), MinMaxState()
    >>> a.absorb(np.array([-1.0]), np.array([2.0]))
    >>> b.merge_state(a.state()); b.absorb(np.array([-3.0]), np.array([1.0]))
    >>> b.lo.tolist(), b.hi.tolist()
    ([-3.0], [2.0])
    """

    lo: np.ndarray | None = None
    hi: np.ndarray | None = None

    def absorb(self, lo: np.ndarray, hi: np.ndarray) -> None:
        if self.lo is None:
            self.lo, self.hi = lo, hi
            return
        if lo.shape != self.lo.shape:
            raise ValueError(f"channel count changed from {self.lo.size} to {lo.size}")
        self.lo = np.minimum(self.lo, lo)
        self.hi = np.maximum(self.hi, hi)

    def state(self) -> dict[str, np.ndarray]:
        if self.lo is None:
            return {"lo": np.zeros(0), "hi": np.zeros(0)}
        return {"lo": np.array(self.lo, np.float64), "hi": np.array(self.hi, np.float64)}

    def merge_state(self, state: dict[str, np.ndarray]) -> None:
        state = check_state(self, state, ("lo", "hi"))
        if state["lo"].size:
            self.absorb(state["lo"].astype(np.float64), state["hi"].astype(np.float64))


class AxisCalibrator:
    """Base of a calibrator without options (a frozen dataclass without fields) whose
    observer, ``observer_type(axis)``, needs no data range."""

    name: ClassVar[str]
    needs_range: ClassVar[bool] = False
    observer_type: ClassVar[type]

    def observer(self, axis: int | None = None, data_range=None):
        return self.observer_type(axis)


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
