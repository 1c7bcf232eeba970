"""The simulated module and everything calibrate and realize need to know about it:
:class:`SimResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq.config import Config
from autoq.ir.graph import Graph
from autoq.ir.matching import Matched
from autoq.ir.registry import Match
from autoq.primitives import dequantize
from autoq.qparams import QParams, SlotInfo
from autoq.rules import lut_channels
from autoq.simulation.context import SlotPlan

__all__ = ["SimResult"]


@dataclass
class SimResult:
    """The simulated module and everything calibrate/realize need to know about it."""

    mod: tvm.IRModule
    graph: Graph
    matches: list[Match]
    plan: SlotPlan
    qparam_vars: dict[str, tuple[relax.Var, relax.Var]]
    sq_vars: dict[str, relax.Var]
    #: layer -> its ``<layer>.enable`` parameter (``switches=True`` only; see module doc)
    switch_vars: dict[str, relax.Var] = field(default_factory=dict)
    #: Var of the prepared fp32 graph -> the simulated graph's value for it
    values: dict = field(default_factory=dict)
    #: layer -> the slots it reads or writes
    layer_slots: dict[str, list[str]] = field(default_factory=dict)
    #: every match of the model (fallback not applied): realize and the analysis reuse it
    matched: Matched | None = None
    #: layer -> its ``<layer>.table`` input (see :meth:`SimContext.lut_output`)
    table_vars: dict[str, relax.Var] = field(default_factory=dict)
    #: ``<layer>.weight`` / ``<layer>.bias`` -> its value input (``Config.tunes_weights``)
    value_vars: dict[str, relax.Var] = field(default_factory=dict)
    #: the configuration it was simulated with, resolved (:func:`autoq.recipes.resolve`)
    config: Config | None = None
    #: what later stages derive from ``mod`` once and reuse, by name (the calibration plan
    #: and its functions: :func:`autoq.calibration.calibration_functions`)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def input_values(self, qparams) -> dict[str, np.ndarray]:
        """The value of every qparam, table and weight-value input of ``mod["main"]``, by
        parameter name, for ``qparams`` (switches and weights not included)."""
        out: dict[str, np.ndarray] = {}
        for sid, (s, z) in self.qparam_vars.items():
            out[s.name] = np.asarray(qparams[sid].scale, np.float32)
            out[z.name] = np.asarray(qparams[sid].zero_point, np.int32)
        for layer, var in self.table_vars.items():
            out[var.name] = self.table(layer, qparams)
        for key, var in self.value_vars.items():
            out[var.name] = self.value_input(key, qparams)
        return out

    def value_input(self, key: str, qparams=None) -> np.ndarray:
        """The float value of weight-value input ``key`` (``<layer>.weight`` or
        ``<layer>.bias``): the integers ``qparams.values[key]`` chose, dequantized (they
        quantize back to themselves exactly: ``|q| <= 2**22``, see ``BIAS_LIMIT``), else the
        model's float tensor."""
        fixed = qparams.values if isinstance(qparams, QParams) else {}
        if key in self.plan.weights:
            arr = self.plan.weights[key][0]
            if key not in fixed:
                return arr
            qp = qparams[key]
            return dequantize(fixed[key], qp.scale, qp.zero_point, qp.axis)
        arr, x_sid, w_sid = self.plan.biases[key.removesuffix(".bias")]
        if key not in fixed:
            return arr
        acc = np.float32(qparams[x_sid].scale) * qparams[w_sid].scale  # the graph's float32
        return (fixed[key].astype(np.float64) * acc.astype(np.float64)).astype(np.float32)

    def table(self, layer: str, qparams) -> np.ndarray:
        """``layer``'s lookup table (float32 integers) for ``qparams``."""
        in_sid, out_sid, act = self.plan.tables[layer]
        return lut_channels.table(act, qparams[in_sid], qparams[out_sid]).astype(np.float32)

    @property
    def slots(self) -> dict[str, SlotInfo]:
        return self.plan.slots

    @property
    def layers(self) -> list[str]:
        return [m.layer for m in self.matches]

    def activation_slots(self) -> list[str]:
        return [s for s, info in self.plan.slots.items() if info.kind == "activation"]

    def weight_slots(self) -> list[str]:
        return [s for s, info in self.plan.slots.items() if info.kind == "weight"]
