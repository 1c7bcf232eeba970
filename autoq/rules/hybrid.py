"""Static + dynamic hybrid: some layers quantize their input at run time, the rest statically.

``Config(activation=<static spec>, overrides=(Override("<dense ids>",
activation=QuantSpec(dynamic=True, granularity="token")),))`` keeps the calibrated static
int8 (int16 with the escalation) for every layer except the ones the override names, which
get the dynamic form of :mod:`autoq.realization.dynamic`: their input goes through
``qnn.dynamic_quantize`` (scale and zero point from the tensor's min/max at run time, per
tensor or per token), the int8 weight is a constant, ``qnn.dense`` accumulates in int32 and
the result leaves integer space as ``float32(acc) * (s_x * s_w)`` with the float32 bias and
residual added after it. Only layers whose pattern has a dynamic form (``Pattern.dynamic``:
the dense kind) can be dynamic; naming another layer is an error.

The three stages see the same graph:

* **simulate** emits the dynamic layers through ``Pattern.simulate_dynamic``: the same
  ``qnn.dynamic_quantize`` as the realized module (:func:`emit_dynamic_quantize`), its
  integers as float32 (:func:`simulated_input`), the layer's op on them and the weight's
  simulated integers, times the same run-time scale product. A dynamic layer has no
  activation slot for its input, so calibration chooses the downstream static ranges on the
  values the dynamic layers really produce;
* **calibrate** chooses the dynamic layers' weight qparams like any weight slot; their
  weights are not tuned by GPTQ / bias correction (those need a calibrated input slot), so
  they round to nearest as in the whole-model dynamic mode;
* **realize** emits the dynamic layers through ``Pattern.dynamic`` with the calibrated
  weight qparams.

A dynamic layer's result is float32, not an int32 accumulator: it is no "int32 carrier"
(no exit slot, :mod:`autoq.rules.exits`), and a static layer's int32 result read by a dynamic
layer reaches it dequantized (float), as it reaches any float consumer before its exit slot
would round it (the dynamic quantize rounds it instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tvm import relax

from autoq import qnn
from autoq.config import Config, QuantSpec
from autoq.ir.registry import Match
from autoq.ir.toolkit import const

__all__ = [
    "DynamicQ",
    "SimulatedDynamicQ",
    "callbacks",
    "check_dynamic_layers",
    "dynamic_key",
    "dynamic_names",
    "emit_dynamic_quantize",
    "simulated_input",
]

_FIELDS = ((0, "q"), (1, "scale"), (2, "zero_point"))


@dataclass(frozen=True)
class DynamicQ:
    """A tensor quantized at run time: int values ``q`` and the run-time ``scale_c`` /
    ``zero_point_c`` (0-d, or per row with a trailing 1) of ``qnn.dynamic_quantize``."""

    q: relax.Expr
    scale_c: relax.Expr
    zero_point_c: relax.Expr


@dataclass(frozen=True)
class SimulatedDynamicQ:
    """The simulated graph's view of a :class:`DynamicQ`: ``centered`` = ``q - zero_point``
    as float32 integers and the run-time ``scale`` (float32)."""

    centered: relax.Expr
    scale: relax.Expr


def is_dynamic(config: Config, m: Match) -> bool:
    """The activation spec of ``m``'s layer (after the overrides) is dynamic."""
    return config.layer_spec("activation", m.layer, m.pattern.name).dynamic


def dynamic_names(config: Config, matches: list[Match]) -> frozenset[str]:
    """The layers of ``matches`` quantized with run-time activation qparams."""
    return frozenset(m.layer for m in matches if is_dynamic(config, m))


def check_dynamic_layers(config: Config, matches: list[Match]) -> None:
    """Every layer with a dynamic activation spec must have a dynamic form: else an error
    naming the layer, its pattern and the rule that made it dynamic."""
    for m in matches:
        if not is_dynamic(config, m) or m.pattern.dynamic is not None:
            continue
        rules = [o.match for o in config.overrides if o.activation and o.activation.dynamic]
        source = f"Override{tuple(rules)}" if rules else "Config.activation"
        raise ValueError(
            f"layer {m.layer!r} (pattern {m.pattern.name!r}) has a dynamic activation spec "
            f"(from {source}) but no dynamic form: only layers with a constant weight "
            "(dense) quantize their input at run time; narrow the override's match to the "
            "dense layers (e.g. Override('pattern:dense*', ...)), or keep the layer in fp32 "
            "with Fallback"
        )


def callbacks(layers: frozenset[str], static: str, dynamic: str) -> Callable[[Match], str]:
    """The pattern callback name for each match: ``dynamic`` for the dynamic ``layers``
    (:func:`dynamic_names`), else ``static`` (see :func:`autoq.simulation.build_function`)."""

    def name(m: Match) -> str:
        return dynamic if m.layer in layers else static

    return name


def dynamic_key(sid: str, spec: QuantSpec) -> tuple:
    """Layers reading tensor ``sid`` with equal keys share one ``qnn.dynamic_quantize``."""
    return (sid, spec.granularity, spec.dtype, spec.symmetric, spec.narrow_range, spec.reduce_range)


def emit_dynamic_quantize(emit, value: relax.Expr, spec: QuantSpec, sid: str) -> DynamicQ:
    """``qnn.dynamic_quantize(value)`` with ``spec`` and its three fields, each bound with
    ``emit(expr, name)``."""
    call = qnn.dynamic_quantize(
        value, spec.granularity, spec.dtype, spec.symmetric, spec.narrow_range,
        spec.reduce_range,
    )  # fmt: skip
    t = emit(call, f"{sid}.dq")
    return DynamicQ(*[emit(relax.TupleGetItem(t, i), f"{sid}.{n}") for i, n in _FIELDS])


def simulated_input(emit, dq: DynamicQ, value: relax.Expr, enable=None) -> SimulatedDynamicQ:
    """``dq``'s integers as float32 ``q - zero_point`` (exact: |q - zp| <= 255). With a
    layer switch ``enable`` (float32 scalar, :mod:`autoq.simulation`): zero gives ``value /
    scale`` unrounded, so the layer computes its float result."""
    q = relax.op.astype(dq.q, "float32")
    centered = emit(relax.op.subtract(q, relax.op.astype(dq.zero_point_c, "float32")))
    if enable is not None:
        on = relax.op.greater(enable, const(0.0, "float32"))
        centered = emit(relax.op.where(on, centered, relax.op.divide(value, dq.scale_c)))
    return SimulatedDynamicQ(centered, dq.scale_c)
