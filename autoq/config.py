"""Configuration: frozen dataclasses, validated on construction, round-tripping through JSON.

>>> cfg = Config(activation=QuantSpec(calibrator="percentile"), fallback=Fallback(ids=("fc",)))
>>> Config.from_json(cfg.to_json()) == cfg
True
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import primitives as P
from .errors import InputError
from .json_document import JsonDocument, check_keys
from .layer_rules import (
    FALLBACK_TYPES,
    AutoFallback,
    Fallback,
    compile_layer_rule,
    compile_rule,
    str_tuple,
)
from .smoothing import check_alpha, check_alphas
from .token_mask import TokenMask

__all__ = [
    "AutoFallback",
    "Config",
    "Distributed",
    "Fallback",
    "Override",
    "QuantSpec",
    "TokenMask",
    "compile_rule",
]

CALIBRATION_MODES = ("topological", "fp32")
WEIGHT_ROUNDINGS = ("nearest", "gptq")
_QSPEC_DTYPES = ("int8", "uint8", "int16")
#: granularities of dynamic (run-time) activation qparams, see :mod:`autoq.dynamic`
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
    :mod:`autoq.dynamic`. ``granularity`` (dynamic only): ``"tensor"`` (one scale) or
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
    to appear. Each shard caches its activations within ``Config.memory_budget_mb``.
    ``retries``: restarts of a lost shard on another worker (:mod:`autoq.remote_shards`).

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


def _default_activation() -> QuantSpec:
    # mse: the only calibrator good on all three benchmark models (benchmarks/vs_onnxruntime.py):
    # best on ResNet-50 and MiniLM, within 0.003 cosine of percentile on PP-OCRv4
    return QuantSpec(dtype="int8", symmetric=False, calibrator="mse")


def _default_weight() -> QuantSpec:
    return QuantSpec(
        dtype="int8", symmetric=True, narrow_range=True, per_channel=True, calibrator="max"
    )


@dataclass(frozen=True)
class Config(JsonDocument):
    """Everything ``autoq.quantize`` can be told.

    ``activation`` / ``weight``: default specs; ``overrides``: per-layer changes.
    ``rounding``: requantize rounding mode (see :data:`autoq.primitives.ROUNDING_MODES`;
    ``float`` is bit-exact with the simulated graph). ``calibration``: ``topological`` (each
    slot calibrated on values carrying the error of every upstream choice) or ``fp32`` (all
    statistics from the float graph, streamed: one pass, two for histogram calibrators).
    ``fallback``: layers kept in fp32.
    ``patterns``: names of the patterns to use (None = all registered).
    ``memory_budget_mb``: RAM for cached activations during calibration (beyond it they
    spill to ``cache_dir`` or a temporary directory). ``progress``: show tqdm bars.
    ``smooth_quant``: SmoothQuant's migration strength alpha (Xiao et al. 2023,
    arXiv:2211.10438; default 0.5, measured best of 0.3/0.5/0.7/0.8 on all-MiniLM-L6-v2),
    None = off: LayerNorm output outliers moved into the dense weights reading them, an
    exact rewrite of the float model before calibration (:mod:`autoq.smooth_quant`); the
    module then realizes ``QuantizeResult.matched`` (the rewritten model), so simulate or
    compare against that, not the input module. Models without a LayerNorm feeding a dense
    layer (CNNs) are unchanged; not applied with dynamic activations (no data).
    ``smooth_quant_alphas``: a grid of migration strengths searched per LayerNorm by the
    output error of the dense layers it feeds (AWQ's per-layer grid search, Lin et al. 2024,
    arXiv:2306.00978, applied to SmoothQuant's factor; :mod:`autoq.smooth_alpha`); empty
    (default): every LayerNorm uses ``smooth_quant``.
    ``skip_unbounded``: ``autoq.quantize`` keeps in fp32 the layers whose activations hold
    inf-like sentinels such as attention masks of ``finfo.min`` (see :mod:`autoq.guard`).
    ``check_scales``: layers whose activation scale cannot represent its data go fp32 (:mod:`autoq.scale_health`).
    ``distributed``: calibrate on a Dask cluster (:class:`Distributed`); None (default):
    in this process, without importing Dask.
    ``int16_tensors``: activation slot ids quantized as int16 (:mod:`autoq.escalation`).
    ``token_mask``: a :class:`TokenMask` naming the model's ``(batch, seq)`` padding-mask
    input: calibration statistics (observers, weight tuning, SmoothQuant, the escalation's
    ranges) then see only the real tokens of the tensors laid out per token
    (:mod:`autoq.token_mask`); None (default): every position.
    ``int8_outputs``: the model's outputs also leave the integer graph as int8 (an exit slot,
    see :mod:`autoq.exits`, on every output an int32 result feeds). Off by default: an output
    reads its layer's int32 accumulator through one ``qnn.dequantize``, which keeps the
    accumulator's precision (rounding the output to int8 costs fidelity: measured 0.054 ->
    0.071 relative error on the test MLP) and is still integer up to that dequantize.

    Data-aware weights (:mod:`autoq.weight_tuning`; run inside topological calibration, on
    each conv/dense layer's quantized input, just before the layer's output is observed):
    ``weight_rounding``: ``"gptq"`` (default; Frantar et al. 2022, arXiv:2210.17323: columns
    rounded in order, the error fed forward through ``H = 2 X^T X / n``; :mod:`autoq.gptq`)
    or ``"nearest"`` (each weight on its own; weights stay constants of the simulated graph). ``bias_correction``: add the mean
    output shift the rounded weights cause, ``(W - W_q) E[x]``, to the bias (Nagel et al.
    2019, "Data-Free Quantization", sec. 4.2, with the empirical input mean;
    :mod:`autoq.bias_correction`). ``empirical_bias_correction``: the empirical form (Finkelstein
    et al. 2019, "Fighting Quantization Bias With Bias"; Nagel et al. 2019's empirical
    variant): each layer's mean output on the calibration data is matched to the fp32
    model's, ``W E[x_fp32] - W_q E[x~]`` added to the bias, where ``x~`` is the layer's
    quantized-so-far input; this also removes the mean error arriving from upstream (costs
    one fp32 pass over the calibration data; supersedes ``bias_correction``).
    ``bias_correction_holdout``: with ``empirical_bias_correction``, the last this many
    calibration samples are held out of calibration and each layer's correction is kept only
    if it lowers the layer's output error against fp32 on them (:mod:`autoq.bias_gate`;
    0, the default: every correction kept; topological calibration only; on a Dask
    cluster the held-out samples are one shard of their own).
    ``bias_correction_skip``: layer-id rules (exact ids, globs, ``re:<regex>``) of layers
    whose bias is NOT corrected by ``bias_correction`` / ``empirical_bias_correction`` (their
    weights are still tuned; a rule that matches no tuned layer is an error when calibration
    starts). For a layer whose output goes int16 (PP-OCRv4 det's stem conv: its int16 output
    keeps a low-contrast blob of the fp32 map, its correction erases it again).
    ``scale_search``: per-channel weight scales chosen on a
    grid of clipping ratios by the layer's output MSE (OMSE, Choukroun et al. 2019;
    :mod:`autoq.scale_search`). The integer weights and biases they choose are carried in
    ``QParams.values`` (realized as they are; simulated exactly). EfficientNet-Lite0 top-1
    agreement (benchmarks/results/accuracy.md): nearest 0.806, GPTQ 0.919 (so the default).

    ``dynamic_gptq``: the hybrid's dynamic dense layers (:mod:`autoq.hybrid`, which have
    no input slot for the weight tuner) get GPTQ-rounded weights too, on the Hessian of
    their fp32 inputs (:mod:`autoq.dynamic_gptq`; needs ``weight_rounding="gptq"`` and
    topological calibration). Default off: their weights round to nearest.

    ``lut_input_ranges``: the range of a slot read only by 8-bit table-lookup activations
    is cut where the activation is flat (hardswish below -3, sigmoid beyond +-17, ...;
    :mod:`autoq.lut_ranges`): the same table outputs on a finer input grid. Default off:
    measured +0.1 IoU point on PP-OCRv4 det (post hoc) but -3 NN@1 points on
    all-MiniLM-L6-v2 (all int8 75.0% -> 71.9%, cos 0.93975 -> 0.93720; with the int16
    escalation 93.8% -> 90.6%, cos 0.99223 -> 0.99167; README).

    Per-channel activation scales and zero points (axis 1 of NCHW tensors, else the last
    axis), each opt-in (README). ``lut_input_per_channel``: a conv output read only by one
    8-bit lookup (hardswish, ...): the conv's requantize writes each channel's grid, one
    256-entry table per channel (:mod:`autoq.lut_channels`); last axis: a lookup's input and
    output written / read by float ops and dynamic layers (GELU, :mod:`autoq.residual_channels`).
    ``depthwise_input_per_channel``: an 8-bit tensor read only by a depthwise conv, written
    by a lookup or a conv: the ``[C, 256]`` table or the conv's requantize writes each
    channel's grid, the depthwise ``qnn.conv2d`` takes a per-channel input scale and zero
    point (exact: channel ``c`` reads only channel ``c``; :mod:`autoq.depthwise_channels`).
    ``residual_per_channel``: a residual-stream tensor (written by a float op, a dynamic
    layer or an 8-bit ``add``; read only by such), per channel of the hidden dimension where
    a transformer's outliers sit: ``qnn.add`` requantizes each channel on its own grid,
    LayerNorm dequantizes per channel (:mod:`autoq.residual_channels`); with
    ``residual_int16_per_channel`` one in ``int16_tensors`` stays per channel, in int16.

    ``equalization``: cross-layer equalization of the float model before calibration (Nagel
    et al. 2019, "Data-Free Quantization", sec. 4.1; :mod:`autoq.cross_layer_equalization`):
    the weights of ``conv -> [bias] -> [relu] -> conv`` chains rescaled per channel so both
    layers' per-channel ranges match, the float function unchanged; chains through clip
    (ReLU6) are skipped (not exact). Off by default: with per-channel weight scales it only
    moves range between layers (see the README's accuracy table).
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
    skip_unbounded: bool = True
    check_scales: bool = True
    int8_outputs: bool = False
    distributed: Distributed | None = None
    weight_rounding: str = "gptq"
    bias_correction: bool = False
    empirical_bias_correction: bool = False
    bias_correction_holdout: int = 0
    bias_correction_skip: tuple[str, ...] = ()
    scale_search: bool = False
    equalization: bool = False
    int16_tensors: tuple[str, ...] = ()
    smooth_quant: float | None = 0.5
    smooth_quant_alphas: tuple[float, ...] = ()
    token_mask: TokenMask | None = None
    lut_input_ranges: bool = False
    dynamic_gptq: bool = False
    lut_input_per_channel: bool = False
    depthwise_input_per_channel: bool = False
    residual_per_channel: bool = False
    residual_int16_per_channel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.activation, QuantSpec) or not isinstance(self.weight, QuantSpec):
            raise TypeError("Config.activation and Config.weight must be QuantSpec instances")
        if self.activation.per_channel:
            raise ValueError(
                "per-channel activations are not supported: set per_channel only on the weight spec"
            )
        _check_dynamic_config(self)
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
            str_tuple(self, "patterns")
        if not (isinstance(self.memory_budget_mb, int | float) and self.memory_budget_mb >= 0):
            raise ValueError(f"Config.memory_budget_mb must be >= 0, got {self.memory_budget_mb!r}")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise ValueError(
                f"Config.weight_rounding must be one of {', '.join(WEIGHT_ROUNDINGS)}, got {self.weight_rounding!r}"
            )
        for name in ("progress", "skip_unbounded", "check_scales", "int8_outputs",
                     "bias_correction", "empirical_bias_correction", "scale_search",
                     "equalization", "lut_input_ranges", "dynamic_gptq",
                     "lut_input_per_channel", "depthwise_input_per_channel",
                     "residual_per_channel", "residual_int16_per_channel"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")
        if self.residual_int16_per_channel and not self.residual_per_channel:
            raise InputError("Config.residual_int16_per_channel needs residual_per_channel=True")
        gptq = (self.weight_rounding, self.calibration) == ("gptq", "topological")
        if self.dynamic_gptq and not gptq:
            raise ValueError(
                "Config.dynamic_gptq needs weight_rounding='gptq' and calibration='topological', "
                f"got {self.weight_rounding!r} and {self.calibration!r}"
            )
        if self.dynamic_gptq and self.distributed is not None:
            raise ValueError("Config.dynamic_gptq runs in this process: not with distributed")
        _check_holdout(self)
        _check_bias_skip(self)
        str_tuple(self, "int16_tensors")
        check_alpha(self.smooth_quant)
        check_alphas(self.smooth_quant_alphas, self.smooth_quant)
        if self.token_mask is not None and not isinstance(self.token_mask, TokenMask):
            raise InputError(
                f"Config.token_mask must be a TokenMask('<mask input name>') or None, got "
                f"{self.token_mask!r}"
            )
        if self.distributed is not None and not isinstance(self.distributed, Distributed):
            raise TypeError(
                f"Config.distributed must be a Distributed or None, got {self.distributed!r}"
            )
        for name in ("lut_input_per_channel", "depthwise_input_per_channel",
                     "residual_per_channel"):  # fmt: skip
            if getattr(self, name) and self.distributed is not None:
                raise InputError(
                    f"Config.{name} is not supported with Config.distributed (the "
                    "workers' statistics are per tensor): calibrate in-process or turn it off"
                )

    def replace(self, **changes: Any) -> Config:
        return replace(self, **changes)

    @property
    def tunes_weights(self) -> bool:
        """Calibration may change weight values or biases (the simulated graph then reads
        them as inputs: see :meth:`autoq.simulate.SimContext.weight`)."""
        return (
            self.weight_rounding != "nearest"
            or self.bias_correction
            or self.empirical_bias_correction
        )

    @property
    def weight_tuning(self) -> bool:
        """Any data-aware weight step is on (:mod:`autoq.weight_tuning`)."""
        return self.tunes_weights or self.scale_search

    def layer_spec(self, kind: str, layer: str, pattern: str | None = None, slot=None) -> QuantSpec:
        """The ``"activation"`` or ``"weight"`` spec of ``layer`` (its pattern's name
        ``pattern``, needed by ``pattern:`` rules): the default, changed by every override
        whose rule matches the layer (the last one wins); in int16 when ``Config.int16_tensors``
        names the activation ``slot`` the layer writes (:mod:`autoq.escalation`)."""
        spec = self.activation if kind == "activation" else self.weight
        for o in self.overrides:
            if compile_layer_rule(o.match)(layer, pattern):
                spec = (o.activation if kind == "activation" else o.weight) or spec
        return spec.as_int16() if slot is not None and slot in self.int16_tensors else spec

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
            "skip_unbounded": self.skip_unbounded,
            "check_scales": self.check_scales,
            "int8_outputs": self.int8_outputs,
            "distributed": None if self.distributed is None else self.distributed.to_json(),
            "weight_rounding": self.weight_rounding,
            "bias_correction": self.bias_correction,
            "empirical_bias_correction": self.empirical_bias_correction,
            "bias_correction_holdout": self.bias_correction_holdout,
            "bias_correction_skip": list(self.bias_correction_skip),
            "scale_search": self.scale_search,
            "equalization": self.equalization,
            "int16_tensors": list(self.int16_tensors),
            "smooth_quant": self.smooth_quant,
            "smooth_quant_alphas": list(self.smooth_quant_alphas),
            "token_mask": None if self.token_mask is None else self.token_mask.to_json(),
            "lut_input_ranges": self.lut_input_ranges,
            "dynamic_gptq": self.dynamic_gptq,
            "lut_input_per_channel": self.lut_input_per_channel,
            "depthwise_input_per_channel": self.depthwise_input_per_channel,
            "residual_per_channel": self.residual_per_channel,
            "residual_int16_per_channel": self.residual_int16_per_channel,
        }

    @classmethod
    def from_json(cls, d: dict) -> Config:
        d = dict(d)
        check_keys(cls, d)
        if "activation" in d:
            d["activation"] = QuantSpec.from_json(d["activation"])
        if "weight" in d:
            d["weight"] = QuantSpec.from_json(d["weight"])
        if "fallback" in d:
            fb = dict(d["fallback"])
            kind = fb.pop("type", "Fallback")
            d["fallback"] = FALLBACK_TYPES[kind].from_json(fb)
        if "overrides" in d:
            d["overrides"] = tuple(Override.from_json(o) for o in d["overrides"])
        if d.get("patterns") is not None:
            d["patterns"] = tuple(d["patterns"])
        d["int16_tensors"] = tuple(d.get("int16_tensors", ()))
        d["smooth_quant_alphas"] = tuple(d.get("smooth_quant_alphas", ()))
        d["bias_correction_skip"] = tuple(d.get("bias_correction_skip", ()))
        if d.get("distributed") is not None:
            d["distributed"] = Distributed.from_json(d["distributed"])
        if d.get("token_mask") is not None:
            d["token_mask"] = TokenMask.from_json(d["token_mask"])
        return cls(**d)


def _check_holdout(config: Config) -> None:
    n = config.bias_correction_holdout
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(
            f"Config.bias_correction_holdout must be an int >= 0 (held-out samples), got {n!r}"
        )
    if n and not config.empirical_bias_correction:
        raise ValueError(
            f"Config.bias_correction_holdout={n} gates empirical bias correction, which is off: "
            "set empirical_bias_correction=True or bias_correction_holdout=0"
        )


def _check_bias_skip(config: Config) -> None:
    str_tuple(config, "bias_correction_skip")
    for rule in config.bias_correction_skip:
        compile_rule(rule)
    if config.bias_correction_skip and not (
        config.bias_correction or config.empirical_bias_correction
    ):
        raise ValueError(
            f"Config.bias_correction_skip={list(config.bias_correction_skip)} exempts layers "
            "from a bias correction that is off: set bias_correction or "
            "empirical_bias_correction, or leave bias_correction_skip empty"
        )


def _check_dynamic_config(config: Config) -> None:
    """Dynamic activations are a whole-model mode (see :mod:`autoq.dynamic`): overrides may
    change the granularity or the weights of a layer but not switch it to static. A static
    model may make layers dynamic with an override (the hybrid, :mod:`autoq.hybrid`)."""
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
                "Override(..., activation=QuantSpec(dynamic=True)) instead: autoq.hybrid; "
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
    """A static model with dynamic layers (:mod:`autoq.hybrid`): the automatic fallback
    searches other than the int16 escalation are not supported with it."""
    rules = [o.match for o in config.overrides if o.activation and o.activation.dynamic]
    fb = config.fallback
    if rules and isinstance(fb, AutoFallback) and fb.precision != "int16_tensors":
        raise ValueError(
            f"AutoFallback(precision={fb.precision!r}) with dynamic layers (Override"
            f"{tuple(rules)} with QuantSpec(dynamic=True)) is not supported: use "
            "AutoFallback(precision='int16_tensors') or Fallback(ids=...)"
        )
