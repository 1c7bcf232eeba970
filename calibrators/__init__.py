"""Calibrators: how a tensor's statistics become a scale and a zero point.

The contract has two steps (and a third object for the statistics):

1. A **calibrator** is a frozen, JSON-serializable dataclass holding the method's options
   (``Percentile(percentile=99.99)``). ``calibrator.observer(axis, data_range)`` returns a
   fresh, empty :class:`Observer`.
2. An **observer** accumulates statistics batch by batch with ``update(x)`` in bounded
   memory (independent of the number of batches), can absorb another shard's statistics
   with ``merge(other)``, and its result does not depend on the order of the batches.
   ``compute(spec)`` returns a :class:`autoq.qparams.QParam` for the requested
   :class:`autoq.config.QuantSpec` (dtype, symmetric, narrow/reduce range).

``axis`` is None for per-tensor statistics, or the channel dimension for per-channel ones
(weights). A calibrator whose ``needs_range`` is True (histogram methods) is given the exact
``data_range=(lo, hi)`` of the data, gathered by the driver in a first min/max pass, so
that its histogram bins are fixed before any data arrives: one observer pass over the data
then gives order-insensitive, mergeable histograms.

A user-written calibrator is any object with that interface (``name``, ``needs_range``,
``observer``), or a plain function ``f(batch: np.ndarray) -> (lo, hi)`` giving a per-batch
range; ranges of all batches are merged by union (see :class:`FunctionCalibrator`).

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

__all__ = [
    "REGISTRY",
    "Calibrator",
    "FunctionCalibrator",
    "Observer",
    "from_json",
    "get",
    "register",
    "to_json",
]


@runtime_checkable
class Observer(Protocol):
    """Streaming statistics of one tensor (see the module docstring)."""

    def update(self, x: np.ndarray) -> None: ...

    def merge(self, other: Observer) -> None: ...

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
    raise TypeError(
        "a calibrator must be a name, an object with name/needs_range/observer, or a function "
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


class _RangeObserver:
    """Union of per-batch (lo, hi) ranges; used by FunctionCalibrator."""

    def __init__(self, fn: Callable, axis: int | None) -> None:
        self.fn, self.axis = fn, axis
        self.lo: np.ndarray | None = None
        self.hi: np.ndarray | None = None

    def update(self, x: np.ndarray) -> None:
        lo, hi = self.fn(x)
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(lo <= hi)):
            raise ValueError(
                f"calibration function {self.fn!r} returned an invalid range ({lo}, {hi})"
            )
        self.lo = lo if self.lo is None else np.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else np.maximum(self.hi, hi)

    def merge(self, other: _RangeObserver) -> None:
        if other.lo is None:
            return
        self.lo = other.lo if self.lo is None else np.minimum(self.lo, other.lo)
        self.hi = other.hi if self.hi is None else np.maximum(self.hi, other.hi)

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


_load_all()
