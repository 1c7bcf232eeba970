"""Calibrators: how a tensor's statistics become a scale and a zero point.

The contract has two objects, the calibrator (options) and its observer (statistics):

1. A **calibrator** is a frozen, JSON-serializable dataclass holding the method's options
   (``Percentile(percentile=99.99)``). ``calibrator.observer(axis, data_range)`` returns a
   fresh, empty :class:`Observer`.
2. An **observer** accumulates statistics batch by batch with ``update(x)`` in bounded
   memory (independent of the number of batches), and its result does not depend on the
   order of the batches. ``compute(spec)`` returns a :class:`autoq.qparams.QParam` for the
   requested :class:`autoq.config.QuantSpec` (dtype, symmetric, narrow/reduce range).
3. Its statistics **merge exactly**: ``state()`` returns them as a dict of plain numeric
   numpy arrays (picklable, cheap to send to another process, no Python objects), and
   ``merge_state(state)`` adds another observer's state; ``merge(other)`` does the same
   with an observer in this process.

``axis`` is None for per-tensor statistics, or the channel dimension for per-channel ones
(weights). A calibrator whose ``needs_range`` is True (histogram methods) is given the exact
``data_range=(lo, hi)`` of the data, gathered by the driver in a first min/max pass
(:func:`range_observer`, itself mergeable), so that its histogram bins are fixed before any
data arrives: one observer pass over the data then gives order-insensitive, mergeable
histograms.

**Exact merging**, the property every built-in observer has (and ``tests/
test_calibrator_merge.py`` checks): split a sequence of batches into any number of shards,
feed each shard in any order to its own observer (all created with the same calibrator,
``axis`` and ``data_range``), merge their states in any order or tree: ``compute(spec)``
gives bit for bit the scale, zero point, rmin and rmax of one observer fed every batch. A
*batch* is one ``update`` call: only ``moving_average`` depends on how the data is cut into
batches (by definition; the drivers make one batch per sample), the others not even on that.
The statistics are integers (histogram counts, exact sums) or min/max, never float sums,
and only the merged statistics are turned into qparams (see each module).

A user-written calibrator is any object with that interface (``name``, ``needs_range``,
``observer``), or a plain function ``f(batch: np.ndarray) -> (lo, hi)`` giving a per-batch
range; ranges of all batches are merged by union (see :class:`FunctionCalibrator`).
In-process calibration needs only ``update`` and ``compute``. Distributed calibration also
needs ``state`` and ``merge_state``: :func:`check_mergeable` names the calibrator and the
missing methods before any work starts.

Each calibrator lives in its own module of this package and registers itself with
:func:`register`; adding one touches one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from ._common import MaxObserver, MinMaxState

__all__ = [
    "REGISTRY",
    "Calibrator",
    "FunctionCalibrator",
    "Observer",
    "check_mergeable",
    "from_json",
    "get",
    "merge_states",
    "range_observer",
    "register",
    "to_json",
]


@runtime_checkable
class Observer(Protocol):
    """Streaming statistics of one tensor (see the module docstring)."""

    def update(self, x: np.ndarray) -> None: ...

    def merge(self, other: Observer) -> None: ...

    def state(self) -> dict[str, np.ndarray]: ...

    def merge_state(self, state: dict[str, np.ndarray]) -> None: ...

    def compute(self, spec: Any) -> Any:  # (QuantSpec) -> QParam
        ...


@runtime_checkable
class Calibrator(Protocol):
    """A calibration method with its options (frozen dataclass)."""

    name: ClassVar[str]
    needs_range: ClassVar[bool]

    def observer(
        self, axis: int | None = None, data_range: tuple[Any, Any] | None = None
    ) -> Observer: ...


REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: register a calibrator dataclass under ``name``."""

    def deco(cls: type) -> type:
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


def get(spec: str | Calibrator | Callable) -> Calibrator:
    """A calibrator from a registered name, a calibrator object, or a range function."""
    if isinstance(spec, str):
        if spec not in REGISTRY:
            raise ValueError(
                f"unknown calibrator {spec!r}; available: {', '.join(sorted(REGISTRY))}"
            )
        return REGISTRY[spec]()
    if isinstance(spec, Calibrator):
        return spec
    if callable(spec):
        return FunctionCalibrator(spec)
    from autoq.errors import CalibratorError

    raise CalibratorError(
        "calibrator contract: a calibrator must be a name, an object with name/needs_range/observer, or a function "
        f"batch -> (lo, hi); got {type(spec).__name__}"
    )


def to_json(cal: Calibrator) -> dict:
    """``{"name": ..., **options}``; user objects serialize by their import path."""
    if type(cal) in REGISTRY.values():
        return {"name": cal.name, **asdict(cal)}
    if isinstance(cal, FunctionCalibrator):
        fn = cal.fn
        return {"name": "function", "path": f"{fn.__module__}:{fn.__qualname__}"}
    cls = type(cal)
    opts = asdict(cal) if hasattr(cal, "__dataclass_fields__") else {}
    return {"name": "custom", "path": f"{cls.__module__}:{cls.__qualname__}", "options": opts}


def _import_path(path: str):
    mod, _, qual = path.partition(":")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def from_json(d: dict) -> Calibrator:
    d = dict(d)
    name = d.pop("name")
    if name == "function":
        return FunctionCalibrator(_import_path(d["path"]))
    if name == "custom":
        return _import_path(d["path"])(**d.get("options", {}))
    if name not in REGISTRY:
        raise ValueError(f"unknown calibrator {name!r}; available: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(
            f"calibrator {name!r} has no options {sorted(unknown)}; it has {sorted(known)}"
        )
    return cls(**d)


class _RangeObserver(MinMaxState):
    """Union of per-batch (lo, hi) ranges; used by FunctionCalibrator."""

    def __init__(self, fn: Callable, axis: int | None) -> None:
        self.fn, self.axis = fn, axis

    def update(self, x: np.ndarray) -> None:
        out = self.fn(x)
        try:
            lo, hi = out
            lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
            ok = np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(lo <= hi)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            from autoq.errors import CalibratorError

            name = getattr(self.fn, "__qualname__", repr(self.fn))
            raise CalibratorError(
                f"calibrator contract: a calibration function batch -> (lo, hi) must return two "
                f"finite numbers (or per-channel arrays) with lo <= hi; {name} returned "
                f"{str(out)[:80]}"
            )
        self.absorb(lo + 0.0, hi + 0.0)  # + 0.0: one zero, see _common.batch_minmax

    def merge(self, other: _RangeObserver) -> None:
        self.merge_state(other.state())

    def compute(self, spec):
        from autoq.qparams import QParam

        if self.lo is None:
            raise ValueError("no data was observed")
        return QParam.from_range(
            self.lo,
            self.hi,
            spec.dtype,
            spec.symmetric,
            spec.narrow_range,
            spec.reduce_range,
            self.axis,
        )


@dataclass(frozen=True)
class FunctionCalibrator:
    """Wraps a user function ``f(batch) -> (lo, hi)`` (scalars, or arrays for per-channel)."""

    fn: Callable[[np.ndarray], tuple[Any, Any]]
    name: ClassVar[str] = "function"
    needs_range: ClassVar[bool] = False

    def observer(self, axis: int | None = None, data_range=None) -> _RangeObserver:
        return _RangeObserver(self.fn, axis)


def range_observer(axis: int | None = None) -> Observer:
    """The first pass of a ``needs_range`` calibrator: the exact per-channel min/max (a
    ``max`` observer); its ``data_range()`` is the ``data_range`` to create the calibrator's
    observer with, and its state merges like any other."""
    return MaxObserver(axis)


def merge_states(calibrator: Calibrator, states, axis: int | None = None, data_range=None):
    """A fresh observer of ``calibrator`` holding the merge of ``states`` (from ``state()``
    of observers created with the same ``axis`` and ``data_range``, e.g. one per shard)."""
    obs = calibrator.observer(axis=axis, data_range=data_range)
    for st in states:
        obs.merge_state(st)
    return obs


def check_mergeable(calibrator: Calibrator, axis: int | None = None) -> None:
    """Raise a TypeError naming the calibrator and what its observer lacks when its
    statistics cannot be merged across processes (``state`` / ``merge_state``)."""
    probe = calibrator.observer(
        axis=axis, data_range=(0.0, 1.0) if getattr(calibrator, "needs_range", False) else None
    )
    missing = [m for m in ("state", "merge_state") if not callable(getattr(probe, m, None))]
    if missing:
        where = to_json(calibrator).get("path", calibrator.name)
        raise TypeError(
            f"calibrator {calibrator.name!r} ({where}) cannot calibrate distributed: its "
            f"observer {type(probe).__name__} has no {' and no '.join(missing)} method. Add "
            "state() -> dict of numpy arrays and merge_state(state) that merge exactly (see "
            "autoq.calibrators), or calibrate in-process."
        )


_load_all()
