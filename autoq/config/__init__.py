"""Configuration: frozen dataclasses, validated on construction, round-tripping through JSON.

:class:`Config` holds the quantization choices only (at most 16 fields); what a run may use
(memory, cache folder, progress bars, a Dask cluster) is :class:`Resources`, given to
``autoq.Quantizer`` / ``autoq.quantize`` as keyword arguments. The fields a recipe decides
(``activation``, ``rounding``, ``check_scales``, ``rules``, ``bias_correction``) default
to None, "the recipe's choice": a config naming a recipe fills them from it on construction (and puts the recipe's
overrides first); ``recipe="auto"`` (the default) waits for the model, whose structure
picks the recipe when a stage starts (:func:`autoq.recipes.resolve`).

Modules: :mod:`.specs` (QuantSpec, Override, BiasCorrection), :mod:`.resources` (Resources,
Distributed), :mod:`.recipe_table` (the recipes as data), :mod:`.old_json` (configs of the
version before recipes).

>>> cfg = Config(activation=QuantSpec(calibrator="percentile"), fallback=Fallback(ids=("fc",)))
>>> Config.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from autoq import primitives as P
from autoq.config.old_json import from_old_json
from autoq.config.recipe_table import RECIPE_FIELDS, RECIPES
from autoq.config.resources import Distributed, Resources
from autoq.config.specs import BiasCorrection, Override, QuantSpec
from autoq.json_document import JsonDocument, check_keys
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
    "clip_output_ranges": "a tensor written by a clip with finite bounds (ReLU6) is "
    "calibrated by its min / max (autoq.rules.clip_ranges)",
    "residual_per_channel": "a transformer's residual-stream tensors get one grid per channel "
    "of the hidden dimension (autoq.rules.residual_channels)",
    "softmax_input_ranges": "a masked softmax input's grid ends 16 below the scores' minimum "
    "instead of spanning the mask (autoq.rules.softmax_ranges)",
    "lookup_between_dynamic": "a table-lookup layer written and read only by dynamic layers "
    "(a transformer's FFN GELU) runs in float (autoq.rules.dynamic_lookups)",
}


def _default_weight() -> QuantSpec:
    return QuantSpec(
        dtype="int8", symmetric=True, narrow_range=True, per_channel=True, calibrator="max"
    )


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
    ``bias_correction``: :class:`BiasCorrection` (empirical), False (off), or None (the
    recipe's: on in ``depthwise_cnn``).
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
    bias_correction: BiasCorrection | bool | None = None
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
        if bc is not None and bc is not False and not isinstance(bc, BiasCorrection):
            raise TypeError(
                "Config.bias_correction must be autoq.BiasCorrection(holdout=...) (on), False "
                f"(off) or None (the recipe's choice), got {bc!r}"
            )
        str_tuple(self, "int16_tensors")
        _check_alpha(self.smooth_quant)
        _check_rules(self)
        if self.recipe != "auto":
            _fill_from_recipe(self)
            _check_dynamic_config(self)

    def replace(self, **changes: Any) -> Config:
        return replace(self, **changes)

    @property
    def resolved(self) -> bool:
        """Whether the recipe is known (``"auto"`` waits for the model: :func:`autoq.recipes.resolve`)."""
        return self.recipe != "auto"

    def has_rule(self, name: str) -> bool:
        """Whether ``Config.rules`` turns on the activation rule ``name``."""
        if name not in ACTIVATION_RULES:
            raise KeyError(f"no activation rule {name!r}")
        return bool(self.rules) and name in self.rules

    @property
    def tunes_weights(self) -> bool:
        """Calibration may change weight values or biases (the simulated graph then reads
        them as inputs: see :meth:`autoq.simulation.SimContext.weight`)."""
        return self.weight_rounding != "nearest" or self.corrects_bias

    @property
    def corrects_bias(self) -> bool:
        """The empirical bias correction is on (a :class:`BiasCorrection`, given or the
        recipe's)."""
        return isinstance(self.bias_correction, BiasCorrection)

    @property
    def bias_holdout(self) -> int:
        """Held-out samples of the bias-correction gate (0: none, or no bias correction)."""
        return self.bias_correction.holdout if self.corrects_bias else 0

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
            "bias_correction": self.bias_correction.to_json()
            if self.corrects_bias
            else self.bias_correction,
            "int16_tensors": list(self.int16_tensors),
            "smooth_quant": self.smooth_quant,
            "rules": None if self.rules is None else list(self.rules),
        }

    @classmethod
    def from_json(cls, d: dict) -> Config:
        d = dict(d)
        if "recipe" not in d:  # written before recipes: every field is concrete
            d = from_old_json(d)
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
        if isinstance(d.get("bias_correction"), dict):
            d["bias_correction"] = BiasCorrection.from_json(d["bias_correction"])
        return cls(**d)


def _fill_from_recipe(config: Config) -> None:
    """The fields left to the recipe (None) set from it, its overrides the config lacks put
    first (idempotent: a filled config is left as it is)."""
    r = RECIPES[config.recipe]
    for name in RECIPE_FIELDS:
        if getattr(config, name) is None:
            object.__setattr__(config, name, getattr(r, name))
    extra = tuple(o for o in r.overrides if o not in config.overrides)
    if extra:
        object.__setattr__(config, "overrides", extra + config.overrides)


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
