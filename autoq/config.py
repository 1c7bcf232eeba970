"""Configuration: frozen dataclasses, validated on construction, round-tripping through JSON.

:class:`Config` holds the quantization choices only (at most 16 fields); what a run may use
(memory, cache folder, progress bars, a Dask cluster) is :class:`Resources`, given to
``autoq.Quantizer`` / ``autoq.quantize`` as keyword arguments. The fields a recipe decides
(``activation``, ``rounding``, ``check_scales``, ``rules``) default to None, "the recipe's
choice": :func:`autoq.recipes.resolve` fills them from ``Config.recipe`` (``"auto"``: the
recipe the model's structure calls for) and prepends the recipe's overrides.

>>> cfg = Config(activation=QuantSpec(calibrator="percentile"), fallback=Fallback(ids=("fc",)))
>>> Config.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any

from autoq import primitives as P
from autoq.json_document import JsonDocument, check_keys, drop_removed
from autoq.layer_rules import (
    FALLBACK_TYPES,
    AutoFallback,
    Fallback,
    compile_layer_rule,
    compile_rule,
    str_tuple,
)

__all__ = [
    "ACTIVATION_RULES",
    "RECIPE_NAMES",
    "AutoFallback",
    "BiasCorrection",
    "Config",
    "Distributed",
    "Fallback",
    "Override",
    "QuantSpec",
    "Resources",
    "compile_rule",
]

CALIBRATION_MODES = ("topological", "fp32")
WEIGHT_ROUNDINGS = ("nearest", "gptq")
_QSPEC_DTYPES = ("int8", "uint8", "int16")
#: granularities of dynamic (run-time) activation qparams, see :mod:`autoq.realization.dynamic`
DYNAMIC_GRANULARITIES = ("tensor", "token")
#: the named recipes (:mod:`autoq.recipes`); "auto" picks one from the model's structure
RECIPE_NAMES = ("auto", "cnn", "depthwise_cnn", "transformer", "dynamic")
#: ``Config.rules``: how particular activation tensors are quantized, each implemented in
#: :mod:`autoq.rules` (adding one: a module there and a row here)
ACTIVATION_RULES = {
    "lookup_input_ranges": "a tensor read only by 8-bit table lookups has its range cut "
    "where the activation is flat (autoq.rules.lut_ranges)",
    "lookup_per_channel": "a tensor read only by one 8-bit lookup gets one grid (and one "
    "256-entry table) per channel (autoq.rules.lut_channels)",
    "depthwise_per_channel": "an 8-bit input read only by a depthwise conv gets one grid per "
    "channel (autoq.rules.depthwise_channels)",
    "residual_per_channel": "a transformer's residual-stream tensors get one grid per channel "
    "of the hidden dimension (autoq.rules.residual_channels)",
}


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
class Distributed:
    """Calibrate data-parallel on a Dask cluster (see :mod:`autoq.distributed`; needs the
    optional extra ``autoq[dask]``).

    ``scheduler``: the address of a running Dask scheduler (``"tcp://host:8786"``), or None
    for a local cluster of ``workers`` processes started for the run (one thread each).
    ``shards``: how many shards the samples are split into (default: one per worker; shard
    ``i`` lives on worker ``i % workers``). ``timeout_s``: how long to wait for the workers
    to appear. Each shard caches its activations within ``Resources.memory_budget_mb``.
    ``retries``: restarts of a lost shard on another worker (:mod:`autoq.distributed.remote_shards`).

    >>> Distributed.from_json(Distributed(workers=2).to_json()) == Distributed(workers=2)
    True
    """

    scheduler: str | None = None
    workers: int | None = None
    shards: int | None = None
    timeout_s: float = 60.0
    retries: int = 1

    def __post_init__(self) -> None:
        if (s := self.scheduler) is not None and (not isinstance(s, str) or not s):
            raise TypeError(f"Distributed.scheduler must be an address string, got {s!r}")
        for name in ("workers", "shards"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"Distributed.{name} must be an int >= 1 or None, got {v!r}")
        if type(self.retries) is not int or self.retries < 0:  # (bool is not int)
            raise ValueError(f"Distributed.retries must be an int >= 0, got {self.retries!r}")
        if (self.scheduler is None) == (self.workers is None):
            raise ValueError(
                "Distributed needs exactly one of scheduler (the address of a running Dask "
                f"scheduler) or workers (a local cluster of that many processes); got "
                f"scheduler={self.scheduler!r}, workers={self.workers!r}"
            )
        if not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise ValueError(f"Distributed.timeout_s must be > 0, got {self.timeout_s!r}")

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> Distributed:
        check_keys(cls, d)
        return cls(**d)


@dataclass(frozen=True)
class Resources:
    """What a run may use, not what it computes (``autoq.Quantizer(..., memory_budget_mb=,
    cache_dir=, progress=, distributed=)``): the same choices give the same model whatever
    these are.

    ``memory_budget_mb``: RAM for cached activations during calibration (beyond it they
    spill to ``cache_dir`` or a temporary directory). ``progress``: progress bars (None:
    only when standard error is a terminal). ``distributed``: calibrate on a Dask cluster
    (:class:`Distributed`); None: in this process, without importing Dask.

    >>> Resources(memory_budget_mb=-1)
    Traceback (most recent call last):
    ValueError: memory_budget_mb must be a number >= 0 (MB), got -1
    """

    memory_budget_mb: float = 1024.0
    cache_dir: str | None = None
    progress: bool | None = None
    distributed: Distributed | None = None

    def __post_init__(self) -> None:
        m = self.memory_budget_mb
        if isinstance(m, bool) or not isinstance(m, int | float) or not m >= 0:
            raise ValueError(f"memory_budget_mb must be a number >= 0 (MB), got {m!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, str | os.PathLike):
            raise TypeError(f"cache_dir must be a folder path or None, got {self.cache_dir!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise TypeError(f"progress must be True, False or None, got {self.progress!r}")
        if self.distributed is not None and not isinstance(self.distributed, Distributed):
            raise TypeError(f"distributed must be a Distributed or None, got {self.distributed!r}")

    @property
    def show_progress(self) -> bool:
        """Whether to draw progress bars: ``progress``, or (None) standard error is a TTY."""
        if self.progress is not None:
            return self.progress
        return bool(getattr(sys.stderr, "isatty", lambda: False)())


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
    them (:mod:`autoq.accuracy.bias_gate`; topological calibration only). No recipe turns it
    on: it helps EfficientNet-Lite0 and hurts ResNet-50, MiniLM and the PP-OCR recipe
    (docs/accuracy.md).

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


def _default_weight() -> QuantSpec:
    return QuantSpec(
        dtype="int8", symmetric=True, narrow_range=True, per_channel=True, calibrator="max"
    )


#: the fields a recipe fills when they are None (:func:`autoq.recipes.resolve`)
RECIPE_FIELDS = ("activation", "rounding", "check_scales", "rules")


@dataclass(frozen=True)
class Config(JsonDocument):
    """Everything ``autoq.quantize`` can be told about the int8 model it makes.

    ``recipe``: the named recipe the None fields come from (:mod:`autoq.recipes`:
    ``"cnn"``, ``"depthwise_cnn"``, ``"transformer"``, ``"dynamic"``), or ``"auto"``
    (default): the one the model's structure calls for, reported in
    ``QuantizeResult.recipe``.
    ``activation`` / ``weight``: default specs (None: the recipe's); ``overrides``:
    per-layer changes (after the recipe's, so they win).
    ``rounding``: requantize rounding mode (see :data:`autoq.primitives.ROUNDING_MODES`;
    ``float`` is bit-exact with the simulated graph; None: the recipe's). ``calibration``:
    ``topological`` (each slot calibrated on values carrying the error of every upstream
    choice) or ``fp32`` (all statistics from the float graph, streamed: one pass, two for
    histogram calibrators). ``fallback``: layers kept in fp32 (:class:`Fallback`), or
    chosen by measurement (:class:`AutoFallback`).
    ``patterns``: names of the patterns to use (None = all registered).
    ``skip_unbounded``: keep in fp32 the layers whose activations hold inf-like sentinels
    such as attention masks of ``finfo.min`` (see :mod:`autoq.fallback.guard`).
    ``check_scales``: layers whose activation scale cannot represent its data go fp32
    (:mod:`autoq.calibration.scale_health`; None: the recipe's).
    ``int8_outputs``: the model's outputs also leave the integer graph as int8 (an exit slot,
    see :mod:`autoq.rules.exits`). Off by default: an output reads its layer's int32
    accumulator through one ``qnn.dequantize``, which keeps the accumulator's precision.
    ``weight_rounding``: ``"gptq"`` (default; Frantar et al. 2022, arXiv:2210.17323: columns
    rounded in order, the error fed forward through ``H = 2 X^T X / n`` of each layer's
    quantized calibration input; :mod:`autoq.accuracy.gptq`) or ``"nearest"``.
    ``bias_correction``: :class:`BiasCorrection` (empirical), or None (off).
    ``int16_tensors``: activation slot ids quantized as int16 (:mod:`autoq.fallback.escalation`).
    ``smooth_quant``: SmoothQuant's migration strength alpha (Xiao et al. 2023,
    arXiv:2211.10438; default 0.5, measured best of 0.3/0.5/0.7/0.8 on all-MiniLM-L6-v2), None
    = off: LayerNorm output outliers moved into the dense weights reading them, an exact
    rewrite of the float model before calibration (:mod:`autoq.accuracy.smooth_quant`); the
    module then realizes ``QuantizeResult.matched``. Models without a LayerNorm feeding a
    dense layer (CNNs) are unchanged; not applied with dynamic activations (no data).
    ``rules``: names from :data:`ACTIVATION_RULES` (None: the recipe's; ``()``: none).
    """

    recipe: str = "auto"
    activation: QuantSpec | None = None
    weight: QuantSpec = field(default_factory=_default_weight)
    rounding: str | None = None
    calibration: str = "topological"
    fallback: Fallback = field(default_factory=Fallback)
    overrides: tuple[Override, ...] = ()
    patterns: tuple[str, ...] | None = None
    skip_unbounded: bool = True
    check_scales: bool | None = None
    int8_outputs: bool = False
    weight_rounding: str = "gptq"
    bias_correction: BiasCorrection | None = None
    int16_tensors: tuple[str, ...] = ()
    smooth_quant: float | None = 0.5
    rules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.recipe not in RECIPE_NAMES:
            raise ValueError(
                f"Config.recipe must be one of {', '.join(RECIPE_NAMES)}, got {self.recipe!r}"
            )
        if self.activation is not None and not isinstance(self.activation, QuantSpec):
            raise TypeError("Config.activation must be a QuantSpec or None (the recipe's)")
        if not isinstance(self.weight, QuantSpec):
            raise TypeError("Config.weight must be a QuantSpec")
        if self.activation is not None and self.activation.per_channel:
            raise ValueError(
                "per-channel activations are not a QuantSpec option: set per_channel only on "
                "the weight spec (Config.rules names the activation tensors kept per channel)"
            )
        if self.rounding is not None and self.rounding not in P.ROUNDING_MODES:
            raise ValueError(
                f"Config.rounding must be one of {', '.join(P.ROUNDING_MODES)} or None, got "
                f"{self.rounding!r}"
            )
        if self.calibration not in CALIBRATION_MODES:
            raise ValueError(
                f"Config.calibration must be one of {', '.join(CALIBRATION_MODES)}, got "
                f"{self.calibration!r}"
            )
        if not hasattr(self.fallback, "to_json"):
            raise TypeError(
                f"Config.fallback must be a Fallback, got {type(self.fallback).__name__}"
            )
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if not all(isinstance(o, Override) for o in self.overrides):
            raise TypeError("Config.overrides must be Override instances")
        if self.patterns is not None:
            str_tuple(self, "patterns")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise ValueError(
                f"Config.weight_rounding must be one of {', '.join(WEIGHT_ROUNDINGS)}, got "
                f"{self.weight_rounding!r}"
            )
        for name in ("skip_unbounded", "int8_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")
        if self.check_scales is not None and not isinstance(self.check_scales, bool):
            raise TypeError(
                f"Config.check_scales must be True, False or None, got {self.check_scales!r}"
            )
        bc = self.bias_correction
        if bc is not None and not isinstance(bc, BiasCorrection):
            raise TypeError(
                f"Config.bias_correction must be autoq.BiasCorrection(holdout=...) or None, got {bc!r}"
            )
        str_tuple(self, "int16_tensors")
        _check_alpha(self.smooth_quant)
        _check_rules(self)
        if self.resolved:
            _check_dynamic_config(self)

    def replace(self, **changes: Any) -> Config:
        return replace(self, **changes)

    @property
    def resolved(self) -> bool:
        """Whether every field a recipe decides is set (see :func:`autoq.recipes.resolve`)."""
        return self.recipe != "auto" and all(getattr(self, f) is not None for f in RECIPE_FIELDS)

    def has_rule(self, name: str) -> bool:
        """Whether ``Config.rules`` turns on the activation rule ``name``."""
        if name not in ACTIVATION_RULES:
            raise KeyError(f"no activation rule {name!r}")
        return bool(self.rules) and name in self.rules

    @property
    def tunes_weights(self) -> bool:
        """Calibration may change weight values or biases (the simulated graph then reads
        them as inputs: see :meth:`autoq.simulation.SimContext.weight`)."""
        return self.weight_rounding != "nearest" or self.bias_correction is not None

    @property
    def weight_tuning(self) -> bool:
        """Any data-aware weight step is on (:mod:`autoq.accuracy.weight_tuning`)."""
        return self.tunes_weights

    @property
    def bias_holdout(self) -> int:
        """Held-out samples of the bias-correction gate (0: none, or no bias correction)."""
        return 0 if self.bias_correction is None else self.bias_correction.holdout

    def layer_spec(self, kind: str, layer: str, pattern: str | None = None, slot=None) -> QuantSpec:
        """The ``"activation"`` or ``"weight"`` spec of ``layer`` (its pattern's name
        ``pattern``, needed by ``pattern:`` rules): the default, changed by every override
        whose rule matches the layer (the last one wins); in int16 when ``Config.int16_tensors``
        names the activation ``slot`` the layer writes (:mod:`autoq.fallback.escalation`)."""
        if not self.resolved:
            raise RuntimeError(
                "internal error: a Config with recipe fields left to the recipe reached a "
                "stage; resolve it first (autoq.recipes.resolve)"
            )
        spec = self.activation if kind == "activation" else self.weight
        for o in self.overrides:
            if compile_layer_rule(o.match)(layer, pattern):
                spec = (o.activation if kind == "activation" else o.weight) or spec
        return spec.as_int16() if slot is not None and slot in self.int16_tensors else spec

    def to_json(self) -> dict:
        fb = self.fallback
        return {
            "recipe": self.recipe,
            "activation": None if self.activation is None else self.activation.to_json(),
            "weight": self.weight.to_json(),
            "rounding": self.rounding,
            "calibration": self.calibration,
            "fallback": {"type": type(fb).__name__, **fb.to_json()},
            "overrides": [o.to_json() for o in self.overrides],
            "patterns": None if self.patterns is None else list(self.patterns),
            "skip_unbounded": self.skip_unbounded,
            "check_scales": self.check_scales,
            "int8_outputs": self.int8_outputs,
            "weight_rounding": self.weight_rounding,
            "bias_correction": None
            if self.bias_correction is None
            else self.bias_correction.to_json(),
            "int16_tensors": list(self.int16_tensors),
            "smooth_quant": self.smooth_quant,
            "rules": None if self.rules is None else list(self.rules),
        }

    @classmethod
    def from_json(cls, d: dict) -> Config:
        d = dict(d)
        if "recipe" not in d:  # written before recipes: every field is concrete
            d = _from_old_json(d)
        check_keys(cls, d)
        if d.get("activation") is not None:
            d["activation"] = QuantSpec.from_json(d["activation"])
        if "weight" in d:
            d["weight"] = QuantSpec.from_json(d["weight"])
        if "fallback" in d:
            fb = dict(d["fallback"])
            kind = fb.pop("type", "Fallback")
            d["fallback"] = FALLBACK_TYPES[kind].from_json(fb)
        if "overrides" in d:
            d["overrides"] = tuple(Override.from_json(o) for o in d["overrides"])
        for name in ("patterns", "rules"):
            if d.get(name) is not None:
                d[name] = tuple(d[name])
        d["int16_tensors"] = tuple(d.get("int16_tensors", ()))
        if d.get("bias_correction") is not None:
            d["bias_correction"] = BiasCorrection.from_json(d["bias_correction"])
        return cls(**d)


def _check_alpha(alpha) -> None:
    """``Config.smooth_quant`` must be None (off) or a number in (0, 1)."""
    if alpha is None:
        return
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 1:
        raise ValueError(
            f"Config.smooth_quant is SmoothQuant's migration strength alpha, a number in "
            f"(0, 1) such as 0.5, or None (off); got {alpha!r}"
        )


def _check_rules(config: Config) -> None:
    if config.rules is None:
        return
    str_tuple(config, "rules")
    unknown = [r for r in config.rules if r not in ACTIVATION_RULES]
    if unknown:
        raise ValueError(
            f"Config.rules: unknown rule(s) {unknown}; the rules are: "
            + "; ".join(f"{k}: {v}" for k, v in ACTIVATION_RULES.items())
        )


def _rule_moved(rule: str):
    def move(value, d: dict) -> str:
        rules = list(d.get("rules") or [])
        if value and rule not in rules:
            d["rules"] = [*rules, rule]
        return f"Config.rules containing {rule!r}"

    return move


def _ebc_moved(value, d: dict) -> str:
    if value:
        d["bias_correction"] = {"holdout": d.get("bias_correction_holdout") or 0}
    return "Config.bias_correction=BiasCorrection(holdout=...)"


def _holdout_moved(value, d: dict) -> str:
    if isinstance(d.get("bias_correction"), dict):
        d["bias_correction"] = {"holdout": value}
    return "BiasCorrection.holdout"


_RESOURCE = "a keyword argument of autoq.Quantizer / autoq.quantize (--{} on the command line)"
#: Config fields of configs written before recipes (one version back): field -> (its old
#: default, where it went); see :func:`autoq.json_document.drop_removed`
REMOVED_FIELDS = {
    "memory_budget_mb": (1024.0, _RESOURCE.format("memory-budget")),
    "cache_dir": (None, _RESOURCE.format("cache-dir")),
    "progress": (True, _RESOURCE.format("quiet")),
    "distributed": (None, _RESOURCE.format("workers / --scheduler")),
    # the plain (DFQ) correction and these options measured no gain: refused when set
    "bias_correction": (False, None),
    "bias_correction_skip": ((), None),
    "scale_search": (False, None),
    "equalization": (False, None),
    "smooth_quant_alphas": ((), None),
    "token_mask": (None, None),
    "dynamic_gptq": (False, None),
    "residual_int16_per_channel": (False, None),
    # moved into Config.bias_correction / Config.rules
    "empirical_bias_correction": (False, _ebc_moved),
    "bias_correction_holdout": (0, _holdout_moved),
    "lut_input_ranges": (False, _rule_moved("lookup_input_ranges")),
    "lut_input_per_channel": (False, _rule_moved("lookup_per_channel")),
    "depthwise_input_per_channel": (False, _rule_moved("depthwise_per_channel")),
    "residual_per_channel": (False, _rule_moved("residual_per_channel")),
}


def _from_old_json(d: dict) -> dict:
    """A config.json of the version before recipes: the removed fields translated (or
    refused, naming them) and the rest as it was, as the ``cnn`` recipe (its old default)
    with every recipe field concrete."""
    d = drop_removed("Config", d, REMOVED_FIELDS)
    d.setdefault("rules", [])
    d.setdefault("rounding", "float")
    d.setdefault("check_scales", True)
    d.setdefault("activation", QuantSpec(calibrator="mse").to_json())
    d["recipe"] = "cnn"
    return d


def _check_dynamic_config(config: Config) -> None:
    """Dynamic activations are a whole-model mode (see :mod:`autoq.realization.dynamic`): overrides may
    change the granularity or the weights of a layer but not switch it to static. A static
    model may make layers dynamic with an override (the hybrid, :mod:`autoq.rules.hybrid`)."""
    dynamic = config.activation.dynamic
    if config.weight.dynamic or any(o.weight and o.weight.dynamic for o in config.overrides):
        raise ValueError(
            "weights are always quantized statically: set dynamic=True on the activation spec"
        )
    for o in config.overrides:
        if dynamic and o.activation is not None and not o.activation.dynamic:
            raise ValueError(
                f"Override({o.match!r}) has dynamic=False but Config.activation has "
                "dynamic=True: a dynamic model has no calibration, so no layer of it can be "
                "static (make Config.activation static and the chosen layers dynamic with "
                "Override(..., activation=QuantSpec(dynamic=True)) instead: autoq.rules.hybrid; "
                "keep a layer in fp32 with Fallback)"
            )
    if not dynamic:
        _check_hybrid(config)
        return
    if isinstance(config.fallback, AutoFallback):
        raise ValueError(
            "AutoFallback needs calibration data and static qparams; with dynamic activations "
            "use Fallback(ids=...) to keep layers in fp32"
        )
    if config.int8_outputs:
        raise ValueError(
            "Config.int8_outputs needs calibrated output qparams; dynamic layers return float32"
        )


def _check_hybrid(config: Config) -> None:
    """A static model with dynamic layers (:mod:`autoq.rules.hybrid`): the automatic fallback
    searches other than the int16 escalation are not supported with it."""
    rules = [o.match for o in config.overrides if o.activation and o.activation.dynamic]
    fb = config.fallback
    if rules and isinstance(fb, AutoFallback) and fb.precision != "int16_tensors":
        raise ValueError(
            f"AutoFallback(precision={fb.precision!r}) with dynamic layers (Override"
            f"{tuple(rules)} with QuantSpec(dynamic=True)) is not supported: use "
            "AutoFallback(precision='int16_tensors') or Fallback(ids=...)"
        )
