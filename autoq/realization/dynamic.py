"""Dynamic quantization: activation qparams computed at run time, no calibration data.

``Config(activation=QuantSpec(dynamic=True, granularity="tensor" | "token"))`` makes
``autoq.quantize(mod, params, None, config)`` quantize every layer whose pattern has a
dynamic form (``Pattern.dynamic``: today the dense kind, ``matmul(x, W)`` with a constant
weight, with its bias and residual add) like ONNX Runtime's ``quantize_dynamic`` and
PyTorch's dynamic ``Linear``:

* the weight is a static int8 constant (``Config.weight``, per channel by default);
* the input goes through ``qnn.dynamic_quantize``, which computes the scale and zero point
  from the tensor's min/max inside the graph (one pair per tensor, or per row of the last
  axis for ``"token"``), see :func:`autoq.qnn.runtime_qparams.dynamic_qparams`; layers reading
  the same tensor with the same spec share one ``qnn.dynamic_quantize``;
* ``qnn.dense`` accumulates in int32; the result leaves integer space right away as
  ``float32(acc) * (s_x * s_w)`` (a runtime scale times the constant weight scales), and
  the float32 bias and residual are added after it.

Every other layer (convolutions, activation x activation matmuls, adds, LUT activations)
needs static qparams and **stays fp32** in this mode: the result lists them in
``fp32_layers`` with the reason "no dynamic form". Dynamic quantization is a whole-model
mode: an ``Override`` may change a layer's granularity or weight spec but not make it
static, and ``AutoFallback`` / ``int8_outputs`` are refused (see ``Config``); keep a layer
in fp32 with ``Fallback``. A dataset, if given, is not used. The opposite, a static
(calibrated) model with some dense layers dynamic, is :mod:`autoq.rules.hybrid`.
"""

from __future__ import annotations

import numpy as np
import tvm

from autoq.calibration import observe
from autoq.config import Config
from autoq.ir.matching import Matched
from autoq.ir.registry import Match
from autoq.qparams import QParams
from autoq.realization import RealizeContext, finish_module
from autoq.recipes import resolve
from autoq.rules.hybrid import DynamicQ
from autoq.simulation import build_function, validate_overrides

__all__ = ["DynamicContext", "DynamicQ", "dynamic_layers", "realize_dynamic"]

#: why a layer stays fp32 in dynamic mode
NO_DYNAMIC_FORM = "no dynamic form (needs static qparams)"


class DynamicContext(RealizeContext):
    """:class:`autoq.realization.RealizeContext` for the whole-model dynamic mode: weight
    qparams chosen from the weight arrays on first use (no calibration); activations
    quantized by ``qnn.dynamic_quantize`` (:meth:`RealizeContext.dynamic_activation`)."""

    def __init__(self, g, config: Config, matches: list[Match]):
        super().__init__(g, config, QParams(meta={"dynamic": True}), matches)

    def weight(self, expr, axis: int, transpose: tuple[int, ...] | None = None):
        sid = f"{self.layer}.weight"
        if sid not in self.qparams:
            spec = self.config.layer_spec("weight", self.layer, self.match.pattern.name)
            arr = np.asarray(self.g.weight_of(expr).array, np.float32)
            ax = axis % arr.ndim if spec.per_channel else None
            channels = None if ax is None else arr.shape[ax]
            self.qparams.params[sid] = observe(spec, [arr], ax, lambda: [arr], channels)
        return super().weight(expr, axis, transpose)


def dynamic_layers(matched: Matched, config: Config) -> tuple[list[Match], dict[str, str]]:
    """The matches quantized dynamically, and ``{layer: why fp32}`` for the others."""
    active = matched.active(config.fallback)
    on = [m for m in active if m.pattern.dynamic is not None]
    names = {m.layer for m in on}
    reasons = dict.fromkeys(matched.kept_float(config.fallback), "fallback rule")
    reasons.update({m.layer: NO_DYNAMIC_FORM for m in active if m.layer not in names})
    validate_overrides(config, on)
    return on, reasons


def realize_dynamic(matched: Matched, config: Config) -> tuple[tvm.IRModule, QParams, dict]:
    """The dynamically quantized module of ``matched``: ``(module, weight qparams,
    {layer: why fp32})`` (see the module docstring)."""
    config = resolve(config, matched.graph)[0]
    if not config.activation.dynamic:
        raise ValueError("realize_dynamic needs Config(activation=QuantSpec(dynamic=True))")
    matches, reasons = dynamic_layers(matched, config)
    g = matched.graph
    ctx = DynamicContext(g, config, matches)
    func = build_function(g, ctx, matches, "dynamic", desc="realize")
    qparams = ctx.qparams
    qparams.meta["activation"] = config.activation.to_json()
    return finish_module(g, func), qparams, reasons
