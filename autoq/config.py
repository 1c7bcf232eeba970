"""Configuration: frozen dataclasses, validated on construction, round-tripping through JSON.

>>> cfg = Config(activation=QuantSpec(calibrator="percentile"), fallback=Fallback(ids=("fc",)))
>>> Config.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import primitives as P

__all__ = ["Config", "Fallback", "Override", "QuantSpec"]

CALIBRATION_MODES = ("topological", "fp32")
_QSPEC_DTYPES = ("int8", "uint8", "int16")


def _calibrators():
    from autoq import calibrators

    return calibrators


@dataclass(frozen=True)
class QuantSpec:
    """How one kind of tensor (activations or weights) is quantized.

    ``dtype``: int8, uint8 or int16. ``symmetric``: zero point at the middle of the range.
    ``narrow_range``: drop the most negative integer (int8 -> [-127, 127]).
    ``reduce_range``: one bit less (int8 -> [-64, 63]). ``per_channel``: one scale per output
    channel (weights only). ``calibrator``: a registered name ("max", "moving_average",
    "percentile", "kl", "mse"), a calibrator object, or a function ``batch -> (lo, hi)``.
    """

    dtype: str = "int8"
    symmetric: bool = False
    narrow_range: bool = False
    reduce_range: bool = False
    per_channel: bool = False
    calibrator: Any = "max"

    def __post_init__(self) -> None:
        if self.dtype not in _QSPEC_DTYPES:
            raise ValueError(
                f"QuantSpec.dtype must be one of {', '.join(_QSPEC_DTYPES)}, got {self.dtype!r}"
            )
        for name in ("symmetric", "narrow_range", "reduce_range", "per_channel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "calibrator", _calibrators().get(self.calibrator))
        P.qrange(self.dtype, self.narrow_range, self.reduce_range)

    @property
    def qrange(self) -> tuple[int, int]:
        return P.qrange(self.dtype, self.narrow_range, self.reduce_range)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calibrator"}
        d["calibrator"] = _calibrators().to_json(self.calibrator)
        return d

    @classmethod
    def from_json(cls, d: dict) -> QuantSpec:
        d = dict(d)
        _check_keys(cls, d)
        if isinstance(d.get("calibrator"), dict):
            d["calibrator"] = _calibrators().from_json(d["calibrator"])
        return cls(**d)


def _check_keys(cls, d: dict) -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}; it has {sorted(known)}")


def _str_tuple(obj, name: str) -> None:
    v = getattr(obj, name)
    if isinstance(v, str):
        v = (v,)
    v = tuple(v)
    if not all(isinstance(x, str) and x for x in v):
        raise TypeError(
            f"{type(obj).__name__}.{name} must be a sequence of non-empty strings, got {v!r}"
        )
    object.__setattr__(obj, name, v)


def compile_rule(rule: str):
    """A layer-id rule as a predicate: ``re:<regex>`` (full match), a glob (``*``, ``?``,
    ``[...]``), or an exact id."""
    import fnmatch

    if rule.startswith("re:"):
        try:
            rx = re.compile(rule[3:])
        except re.error as e:
            raise ValueError(f"invalid regular expression in rule {rule!r}: {e}") from None
        return lambda s: rx.fullmatch(s) is not None
    if any(c in rule for c in "*?["):
        return lambda s: fnmatch.fnmatchcase(s, rule)
    return lambda s: s == rule


@dataclass(frozen=True)
class Fallback:
    """Layers to keep in fp32 (like NNCF's IgnoredScope).

    ``ids``: exact layer ids; ``op_types``: pattern names or op names (``"conv2d"``,
    ``"matmul"``, ``"add"``); ``patterns``: globs (``"layer4.*"``) or regexes
    (``"re:layer[34]\\..*"``). With ``validate`` (default) a rule that matches no layer is an
    error that lists the closest ids.
    """

    ids: tuple[str, ...] = ()
    op_types: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    validate: bool = True

    def __post_init__(self) -> None:
        for name in ("ids", "op_types", "patterns"):
            _str_tuple(self, name)
        for p in self.patterns:
            compile_rule(p)

    def __bool__(self) -> bool:
        return bool(self.ids or self.op_types or self.patterns)

    def to_json(self) -> dict:
        return {
            "ids": list(self.ids),
            "op_types": list(self.op_types),
            "patterns": list(self.patterns),
            "validate": self.validate,
        }

    @classmethod
    def from_json(cls, d: dict) -> Fallback:
        _check_keys(cls, d)
        return cls(**d)


@dataclass(frozen=True)
class Override:
    """Per-layer override of the activation and/or weight spec; ``match`` is an exact id, a
    glob or ``re:<regex>`` over layer ids (an override that matches nothing is an error)."""

    match: str
    activation: QuantSpec | None = None
    weight: QuantSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise TypeError(f"Override.match must be a non-empty string, got {self.match!r}")
        compile_rule(self.match)
        if self.activation is None and self.weight is None:
            raise ValueError(
                f"Override({self.match!r}) changes nothing: give activation and/or weight"
            )

    def to_json(self) -> dict:
        return {
            "match": self.match,
            "activation": None if self.activation is None else self.activation.to_json(),
            "weight": None if self.weight is None else self.weight.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> Override:
        _check_keys(cls, d)
        return cls(
            match=d["match"],
            activation=None
            if d.get("activation") is None
            else QuantSpec.from_json(d["activation"]),
            weight=None if d.get("weight") is None else QuantSpec.from_json(d["weight"]),
        )


def _default_activation() -> QuantSpec:
    return QuantSpec(dtype="int8", symmetric=False, calibrator="percentile")


def _default_weight() -> QuantSpec:
    return QuantSpec(
        dtype="int8", symmetric=True, narrow_range=True, per_channel=True, calibrator="max"
    )


@dataclass(frozen=True)
class Config:
    """Everything ``autoq.quantize`` can be told.

    ``activation`` / ``weight``: default specs; ``overrides``: per-layer changes.
    ``rounding``: requantize rounding mode (see :data:`autoq.primitives.ROUNDING_MODES`;
    ``float`` is bit-exact with the simulated graph). ``calibration``: ``topological`` (each
    slot calibrated on values carrying the error of every upstream choice) or ``fp32`` (all
    statistics from the float graph in one pass). ``fallback``: layers kept in fp32.
    ``patterns``: names of the patterns to use (None = all registered).
    ``memory_budget_mb``: RAM for cached activations during calibration (beyond it they
    spill to ``cache_dir`` or a temporary directory). ``progress``: show tqdm bars.
    """

    activation: QuantSpec = field(default_factory=_default_activation)
    weight: QuantSpec = field(default_factory=_default_weight)
    rounding: str = "float"
    calibration: str = "topological"
    fallback: Fallback = field(default_factory=Fallback)
    overrides: tuple[Override, ...] = ()
    patterns: tuple[str, ...] | None = None
    memory_budget_mb: float = 1024.0
    cache_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.activation, QuantSpec) or not isinstance(self.weight, QuantSpec):
            raise TypeError("Config.activation and Config.weight must be QuantSpec instances")
        if self.activation.per_channel:
            raise ValueError(
                "per-channel activations are not supported: set per_channel only on the weight spec"
            )
        if self.rounding not in P.ROUNDING_MODES:
            raise ValueError(
                f"Config.rounding must be one of {', '.join(P.ROUNDING_MODES)}, got {self.rounding!r}"
            )
        if self.calibration not in CALIBRATION_MODES:
            raise ValueError(
                f"Config.calibration must be one of {', '.join(CALIBRATION_MODES)}, got {self.calibration!r}"
            )
        if not hasattr(self.fallback, "to_json"):
            raise TypeError(
                f"Config.fallback must be a Fallback, got {type(self.fallback).__name__}"
            )
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if not all(isinstance(o, Override) for o in self.overrides):
            raise TypeError("Config.overrides must be Override instances")
        if self.patterns is not None:
            _str_tuple(self, "patterns")
        if not (isinstance(self.memory_budget_mb, int | float) and self.memory_budget_mb >= 0):
            raise ValueError(f"Config.memory_budget_mb must be >= 0, got {self.memory_budget_mb!r}")

    def replace(self, **changes: Any) -> Config:
        return replace(self, **changes)

    def to_json(self) -> dict:
        return {
            "activation": self.activation.to_json(),
            "weight": self.weight.to_json(),
            "rounding": self.rounding,
            "calibration": self.calibration,
            "fallback": {"type": type(self.fallback).__name__, **self.fallback.to_json()},
            "overrides": [o.to_json() for o in self.overrides],
            "patterns": None if self.patterns is None else list(self.patterns),
            "memory_budget_mb": self.memory_budget_mb,
            "cache_dir": self.cache_dir,
            "progress": self.progress,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, d: dict) -> Config:
        d = dict(d)
        _check_keys(cls, d)
        if "activation" in d:
            d["activation"] = QuantSpec.from_json(d["activation"])
        if "weight" in d:
            d["weight"] = QuantSpec.from_json(d["weight"])
        if "fallback" in d:
            fb = dict(d["fallback"])
            kind = fb.pop("type", "Fallback")
            d["fallback"] = _FALLBACK_TYPES[kind].from_json(fb)
        if "overrides" in d:
            d["overrides"] = tuple(Override.from_json(o) for o in d["overrides"])
        if d.get("patterns") is not None:
            d["patterns"] = tuple(d["patterns"])
        return cls(**d)

    @classmethod
    def loads(cls, s: str) -> Config:
        return cls.from_json(json.loads(s))


#: Fallback kinds that ``Config.from_json`` knows (AutoFallback registers itself here).
_FALLBACK_TYPES: dict[str, Any] = {"Fallback": Fallback}
