"""``autoq.quantize``: simulate -> calibrate -> realize in one call."""

from __future__ import annotations

import tvm

from .calibrate import calibrate
from .config import Config
from .realize import realize
from .simulate import simulate

__all__ = ["quantize"]


def quantize(
    mod: tvm.IRModule, params: dict | None, dataset, config: Config | None = None, target=None
) -> tvm.IRModule:
    """Quantize an fp32 Relax module with a representative dataset.

    ``params``: weight arrays by function-parameter name (None when the weights are bound as
    constants). ``dataset``: an iterable of ``{input_name: array}`` dicts, or of arrays for a
    single-input model. Returns the int8 module (``main`` takes only the model inputs); the
    calibration result is attached as ``result.attrs["autoq.qparams"]`` (JSON text).
    """
    config = config or Config()
    sim = simulate(mod, params, config)
    qparams = calibrate(sim, params, dataset, config, target=target)
    out = realize(mod, params, qparams, config)
    return out.with_attr("autoq.qparams", qparams.dumps())
