"""How one kind of tensor is quantized (:class:`QuantSpec`), per-layer changes of it
(:class:`Override`) and the empirical bias correction's options (:class:`BiasCorrection`).

>>> QuantSpec.from_json(QuantSpec(calibrator="percentile").to_json()).calibrator.name
'percentile'
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from autoq import primitives as P
from autoq.json_document import check_keys
from autoq.layer_rules import compile_layer_rule

__all__ = ["DYNAMIC_GRANULARITIES", "BiasCorrection", "Override", "QuantSpec"]

_QSPEC_DTYPES = ("int8", "uint8", "int16")
#: granularities of dynamic (run-time) activation qparams, see :mod:`autoq.realization.dynamic`
DYNAMIC_GRANULARITIES = ("tensor", "token")


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
    ``dynamic``: activations only: scale and zero point computed at run time inside the
    graph from the tensor's min/max (no calibration data; the calibrator is not used), see
    :mod:`autoq.realization.dynamic`. ``granularity`` (dynamic only): ``"tensor"`` (one scale) or
    ``"token"`` (one scale per row of the last axis).
    """

    dtype: str = "int8"
    symmetric: bool = False
    narrow_range: bool = False
    reduce_range: bool = False
    per_channel: bool = False
    calibrator: Any = "max"
    dynamic: bool = False
    granularity: str = "tensor"

    def __post_init__(self) -> None:
        if self.dtype not in _QSPEC_DTYPES:
            raise ValueError(
                f"QuantSpec.dtype must be one of {', '.join(_QSPEC_DTYPES)}, got {self.dtype!r}"
            )
        for name in ("symmetric", "narrow_range", "reduce_range", "per_channel", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "calibrator", _calibrators().get(self.calibrator))
        P.qrange(self.dtype, self.narrow_range, self.reduce_range)
        _check_dynamic(self)

    @property
    def qrange(self) -> tuple[int, int]:
        return P.qrange(self.dtype, self.narrow_range, self.reduce_range)

    def as_int16(self) -> QuantSpec:
        """This spec with int16 (per tensor): mixed precision for a sensitive tensor."""
        return replace(self, dtype="int16", per_channel=False, dynamic=False)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calibrator"}
        d["calibrator"] = _calibrators().to_json(self.calibrator)
        return d

    @classmethod
    def from_json(cls, d: dict) -> QuantSpec:
        d = dict(d)
        check_keys(cls, d)
        if isinstance(d.get("calibrator"), dict):
            d["calibrator"] = _calibrators().from_json(d["calibrator"])
        return cls(**d)


def _check_dynamic(spec: QuantSpec) -> None:
    """The combinations a dynamic spec refuses, each with how to fix it."""
    if spec.granularity not in DYNAMIC_GRANULARITIES:
        raise ValueError(
            f"QuantSpec.granularity must be one of {', '.join(DYNAMIC_GRANULARITIES)}, "
            f"got {spec.granularity!r}"
        )
    if not spec.dynamic:
        if spec.granularity != "tensor":
            raise ValueError(
                f"QuantSpec(granularity={spec.granularity!r}) needs dynamic=True: static "
                "activations have one calibrated scale per tensor"
            )
        return
    if spec.dtype not in ("int8", "uint8"):
        raise ValueError(
            f"QuantSpec(dynamic=True) quantizes to int8 or uint8 (8-bit qnn.dense kernels), "
            f"got dtype={spec.dtype!r}"
        )
    if spec.per_channel:
        raise ValueError(
            "QuantSpec(dynamic=True, per_channel=True): dynamic activations are per tensor or "
            "per token (granularity='token'), never per channel"
        )


@dataclass(frozen=True)
class Override:
    """Per-layer override of the activation and/or weight spec; ``match`` is an exact id, a
    glob or ``re:<regex>`` over layer ids, or ``pattern:<glob>`` over the layers' pattern
    names (``"pattern:dense*"``: every dense layer, whatever the model calls it); an
    override that matches nothing is an error."""

    match: str
    activation: QuantSpec | None = None
    weight: QuantSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise TypeError(f"Override.match must be a non-empty string, got {self.match!r}")
        compile_layer_rule(self.match)
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
        check_keys(cls, d)
        return cls(
            match=d["match"],
            activation=None
            if d.get("activation") is None
            else QuantSpec.from_json(d["activation"]),
            weight=None if d.get("weight") is None else QuantSpec.from_json(d["weight"]),
        )


@dataclass(frozen=True)
class BiasCorrection:
    """Empirical bias correction (``Config(bias_correction=BiasCorrection())``; Finkelstein
    et al. 2019, "Fighting Quantization Bias With Bias", and the empirical variant of Nagel
    et al. 2019): each conv/dense layer's mean output on the calibration data is matched to
    the fp32 model's, ``W E[x_fp32] - W_q E[x~]`` folded into its int32 bias (``x~``: its
    quantized-so-far input), which also removes the mean error arriving from upstream; one
    extra fp32 pass over the calibration data (:mod:`autoq.accuracy.weight_tuning`).
    ``holdout``: the last this many calibration samples are held out of calibration and a
    layer's correction is kept only if it lowers that layer's output error against fp32 on
    them (:mod:`autoq.accuracy.bias_gate`; topological calibration only). The
    ``depthwise_cnn`` recipe turns it on (MobileNetV2, EfficientNet-Lite0: docs/recipes.md);
    it hurts ResNet-50 and MiniLM (docs/accuracy.md), so the other recipes leave it off.

    >>> BiasCorrection(holdout=8).to_json()
    {'holdout': 8}
    """

    holdout: int = 0

    def __post_init__(self) -> None:
        n = self.holdout
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"BiasCorrection.holdout must be an int >= 0 (held-out samples), got {n!r}"
            )

    def to_json(self) -> dict:
        return {"holdout": self.holdout}

    @classmethod
    def from_json(cls, d: dict) -> BiasCorrection:
        check_keys(cls, d)
        return cls(**d)
