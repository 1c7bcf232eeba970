"""Quantization parameters as data: one :class:`QParam` per slot, a :class:`QParams` set.

A *slot* is one place in the graph that needs a scale and a zero point: an activation
tensor, or a weight. Slots are keyed by stable, human-meaningful ids (see
``docs/design.md``). ``QParams`` round-trips through JSON exactly (float32 scales are
written as the shortest decimal that reads back to the same float32), so a calibration
can be saved, edited by hand, and realized many times.

``QParams.values`` optionally carries *integer tensors fixed by the source* (a pre-quantized
file, see :func:`autoq.import_quantized`): ``<layer>.weight`` -> the int8/uint8 weight and
``<layer>.bias`` -> the int32 bias, both in the layout of the tensor in the fp32 graph.
:func:`autoq.realization` uses them as they are instead of quantizing the float weights (a
calibration result has none). They are written to JSON as base64 of the little-endian bytes,
so the round trip stays exact.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from autoq import primitives as P
from autoq.errors import QParamsError
from autoq.json_document import JsonDocument, parse_json

__all__ = ["QParam", "QParams", "SlotInfo", "load_qparams"]

FORMAT_VERSION = 1


def f32_list(a) -> Any:
    a = np.asarray(a, dtype=np.float32)
    if a.ndim == 0:
        return float(a)
    return [float(v) for v in a]


@dataclass(frozen=True, eq=False)
class QParam:
    """Scale and zero point of one slot.

    ``scale`` (float32) and ``zero_point`` (int32) are 0-D (per-tensor) or 1-D (per-axis)
    arrays; ``axis`` is the dimension they index, in the layout of the tensor as it appears
    in the fp32 graph (None for per-tensor). ``rmin``/``rmax`` record the real range the
    calibrator chose (for reports; not needed to realize).
    """

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: str = "int8"
    axis: int | None = None
    rmin: np.ndarray | None = None
    rmax: np.ndarray | None = None

    def __post_init__(self) -> None:
        scale = np.asarray(self.scale, dtype=np.float32)
        zp = np.asarray(self.zero_point)
        if zp.dtype.kind not in "iu" and not np.all(zp == np.round(zp)):
            raise ValueError(f"zero_point must be integers, got {zp}")
        zp = zp.astype(np.int32)
        if scale.ndim > 1 or zp.ndim > 1:
            raise ValueError("scale and zero_point must be scalars or 1-D arrays")
        if zp.shape != scale.shape:
            if zp.ndim == 0:
                zp = np.full(scale.shape, int(zp), np.int32)
            else:
                raise ValueError(
                    f"zero_point shape {zp.shape} does not match scale shape {scale.shape}"
                )
        if not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
            raise ValueError(f"scale must be positive and finite, got {scale.ravel()[:4].tolist()}")
        if np.any(scale < np.finfo(np.float32).tiny):  # x / scale overflows float32
            bad = scale[scale < np.finfo(np.float32).tiny].ravel()[:4].tolist()
            raise ValueError(
                f"scale must be at least {np.finfo(np.float32).tiny:.4g} (the smallest normal "
                f"float32; a smaller one overflows every value it divides), got {bad}"
            )
        qmin, qmax = P.qrange(self.dtype)
        if np.any(zp < qmin) or np.any(zp > qmax):
            raise ValueError(
                f"zero_point must be inside the {self.dtype} range [{qmin}, {qmax}], got {zp.ravel()[:4].tolist()}"
            )
        if scale.ndim == 1 and self.axis is None:
            raise ValueError("a per-axis QParam needs an axis")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point", zp)
        for name in ("rmin", "rmax"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, np.asarray(v, dtype=np.float32))

    @property
    def per_axis(self) -> bool:
        return self.scale.ndim == 1

    def uniform(self) -> QParam:
        """The per-tensor QParam when every channel of a per-axis one has the same scale and
        zero point (the same grid: quantizing with either gives the same integers), else
        itself.

        >>> QParam(np.full(3, 0.5, np.float32), np.zeros(3), "int8", 1).uniform().axis is None
        True
        """
        if not self.per_axis or self.scale.size == 0:
            return self
        s, z = self.scale[0], self.zero_point[0]
        if np.any(self.scale != s) or np.any(self.zero_point != z):
            return self
        first = [None if v is None else v.reshape(-1)[0] for v in (self.rmin, self.rmax)]
        return QParam(s, z, self.dtype, None, *first)

    @property
    def qmin(self) -> int:
        return P.qrange(self.dtype)[0]

    @property
    def qmax(self) -> int:
        return P.qrange(self.dtype)[1]

    def grid_range(self) -> tuple[np.ndarray, np.ndarray]:
        """The real range the integer grid covers, ``(qmin - zp) * scale`` to ``(qmax - zp) *
        scale`` in float64 (per channel: arrays).

        >>> [float(v) for v in QParam(np.float32(0.5), np.int32(-28), "int8").grid_range()]
        [-50.0, 77.5]
        """
        s, z = self.scale.astype(np.float64), self.zero_point.astype(np.float64)
        return (self.qmin - z) * s, (self.qmax - z) * s

    @classmethod
    def from_range(
        cls,
        rmin,
        rmax,
        dtype: str = "int8",
        symmetric: bool = False,
        narrow_range: bool = False,
        reduce_range: bool = False,
        axis: int | None = None,
    ) -> QParam:
        """QParam for the real range [rmin, rmax] (see :func:`autoq.primitives.choose_qparams`)."""
        scale, zp = P.choose_qparams(rmin, rmax, dtype, symmetric, narrow_range, reduce_range)
        # the effective range: what the integer grid actually covers
        return cls(scale, zp, dtype, axis if np.ndim(scale) == 1 else None, rmin, rmax)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, QParam)
            and self.dtype == other.dtype
            and self.axis == other.axis
            and np.array_equal(self.scale, other.scale)
            and np.array_equal(self.zero_point, other.zero_point)
        )

    def __hash__(self) -> int:
        return hash((self.dtype, self.axis, self.scale.tobytes(), self.zero_point.tobytes()))

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "dtype": self.dtype,
            "axis": self.axis,
            "scale": f32_list(self.scale),
            "zero_point": self.zero_point.tolist(),
        }
        if self.rmin is not None:
            d["rmin"] = f32_list(self.rmin)
        if self.rmax is not None:
            d["rmax"] = f32_list(self.rmax)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> QParam:
        unknown = set(d) - {"dtype", "axis", "scale", "zero_point", "rmin", "rmax"}
        if unknown:
            raise ValueError(f"unknown QParam fields {sorted(unknown)}")
        missing = {"scale", "zero_point"} - set(d)
        if missing:
            raise ValueError(f"missing field(s) {sorted(missing)}")
        axis = d.get("axis")
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise ValueError(f"axis must be an integer or null, got {axis!r}")
        try:
            scale = np.asarray(d["scale"], np.float64)
            zp = np.asarray(d["zero_point"], np.float64)  # cast after the integer check
        except (TypeError, ValueError):
            raise ValueError(
                f"scale and zero_point must be numbers or lists of numbers, got "
                f"{d['scale']!r} and {d['zero_point']!r}"
            ) from None
        if zp.size and not np.all(zp == np.round(zp)):
            raise ValueError(f"zero_point must be integers, got {zp.ravel()[:4].tolist()}")
        return cls(
            scale=scale.astype(np.float32),
            zero_point=zp,
            dtype=d.get("dtype", "int8"),
            axis=axis,
            rmin=None if d.get("rmin") is None else np.asarray(d["rmin"], np.float32),
            rmax=None if d.get("rmax") is None else np.asarray(d["rmax"], np.float32),
        )


@dataclass(frozen=True)
class SlotInfo:
    """What a slot is: ``kind`` is "activation" or "weight"; ``layer`` the id of the layer
    (matched pattern) it belongs to or feeds; ``op`` the op kind; ``shape`` the tensor shape."""

    id: str
    kind: str
    layer: str = ""
    op: str = ""
    shape: tuple[int, ...] = ()
    axis: int | None = None

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "layer": self.layer,
            "op": self.op,
            "shape": list(self.shape),
            "axis": self.axis,
        }

    @classmethod
    def from_json(cls, sid: str, d: Mapping) -> SlotInfo:
        return cls(
            sid,
            d["kind"],
            d.get("layer", ""),
            d.get("op", ""),
            tuple(d.get("shape", ())),
            d.get("axis"),
        )


_VALUE_DTYPES = ("int8", "uint8", "int16", "uint16", "int32")


def _value_to_json(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {
        "dtype": str(a.dtype),
        "shape": list(a.shape),
        "data": base64.b64encode(a.astype(a.dtype.newbyteorder("<")).tobytes()).decode("ascii"),
    }


def _value_from_json(key: str, d: Mapping) -> np.ndarray:
    if d.get("dtype") not in _VALUE_DTYPES:
        raise ValueError(
            f"values[{key!r}]: dtype must be one of {_VALUE_DTYPES}, got {d.get('dtype')!r}"
        )
    dt = np.dtype(d["dtype"]).newbyteorder("<")
    a = np.frombuffer(base64.b64decode(d["data"]), dtype=dt)
    return a.reshape([int(n) for n in d["shape"]]).astype(d["dtype"])


@dataclass
class QParams(JsonDocument, Mapping[str, QParam]):
    """Slot id -> :class:`QParam`, with slot descriptions; the result of calibration.

    ``values``: integer weights/biases fixed by the source (see the module docstring); not
    part of ``==`` (compare them with numpy)."""

    params: dict[str, QParam] = field(default_factory=dict)
    slots: dict[str, SlotInfo] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for sid, qp in self.params.items():
            info = self.slots.get(sid)
            if info is not None and info.shape and qp.axis is not None:
                _check_axis(sid, qp, info.shape)
        self.values = {k: np.asarray(v) for k, v in self.values.items()}
        for k, v in self.values.items():
            if v.dtype.name not in _VALUE_DTYPES:
                raise ValueError(
                    f"values[{k!r}] must be an integer array ({', '.join(_VALUE_DTYPES)}), "
                    f"got {v.dtype}"
                )

    def __getitem__(self, key: str) -> QParam:
        try:
            return self.params[key]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(key, list(self.params), n=3)
            hint = f"; closest ids: {', '.join(close)}" if close else ""
            raise KeyError(f"no qparams for slot {key!r}{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def to_json(self) -> dict:
        d = {
            "format": "autoq.qparams",
            "version": FORMAT_VERSION,
            "meta": self.meta,
            "slots": {k: v.to_json() for k, v in self.slots.items()},
            "qparams": {k: v.to_json() for k, v in self.params.items()},
        }
        if self.values:
            d["values"] = {k: _value_to_json(v) for k, v in self.values.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> QParams:
        if d.get("format") != "autoq.qparams":
            raise ValueError('not an autoq qparams document (missing "format": "autoq.qparams")')
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"unsupported qparams version {d.get('version')}; this autoq reads {FORMAT_VERSION}"
            )
        return cls(
            params={k: _slot_from_json(k, v) for k, v in d.get("qparams", {}).items()},
            slots={k: SlotInfo.from_json(k, v) for k, v in d.get("slots", {}).items()},
            meta=dict(d.get("meta", {})),
            values={k: _value_from_json(k, v) for k, v in d.get("values", {}).items()},
        )

    def replace(self, **updates: QParam) -> QParams:
        """A copy with some slots' qparams replaced (slot ids as keyword names or via dict)."""
        params = dict(self.params)
        for k, v in updates.items():
            if k not in params:
                self[k]  # raises with the closest ids
            params[k] = v
        return QParams(params, dict(self.slots), dict(self.meta), dict(self.values))


def _slot_from_json(sid: str, d) -> QParam:
    """One slot of a qparams document; any problem is a QParamsError naming the slot."""
    try:
        if not isinstance(d, Mapping):
            raise ValueError(f"expected an object with scale and zero_point, got {d!r}")
        return QParam.from_json(d)
    except (ValueError, TypeError, KeyError) as e:
        raise QParamsError(f"qparams slot {sid!r}: {e}") from None


def _check_axis(sid: str, qp: QParam, shape: tuple) -> None:
    """A per-axis slot's axis exists in the tensor and has one scale per channel."""
    if not -len(shape) <= qp.axis < len(shape):
        raise QParamsError(
            f"qparams slot {sid!r}: axis {qp.axis} does not exist in its tensor of shape "
            f"{tuple(shape)}"
        )
    if qp.scale.ndim == 1 and qp.scale.size != shape[qp.axis]:
        raise QParamsError(
            f"qparams slot {sid!r}: {qp.scale.size} scale(s) for {shape[qp.axis]} channels "
            f"(axis {qp.axis} of shape {tuple(shape)}): give one scale and zero point per channel"
        )


def load_qparams(path: str | Path) -> QParams:
    """Read a :class:`QParams` JSON file written by :meth:`QParams.save`; a problem is a
    :class:`autoq.errors.QParamsError` naming the file and the slot."""
    path = Path(path)
    try:
        return QParams.from_json(parse_json(path.read_text(), "the file"))
    except json.JSONDecodeError as e:
        raise QParamsError(f"{str(path)!r} is not JSON: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise QParamsError(f"{str(path)!r}: {e}") from None
