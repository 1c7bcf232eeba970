"""``autoq.quantize``: simulate -> calibrate -> realize in one call."""

from __future__ import annotations

import dataclasses
import warnings

import tvm

from .calibrate import calibrate
from .config import AutoFallback, Config
from .guard import layers_using, unbounded_slots
from .realize import realize
from .simulate import SimResult, simulate

__all__ = ["quantize"]


def quantize(
    mod: tvm.IRModule, params: dict | None, dataset, config: Config | None = None, target=None
) -> tvm.IRModule:
    """Quantize an fp32 Relax module with a representative dataset.

    ``params``: weight arrays by function-parameter name (None when the weights are bound as
    constants). ``dataset``: an iterable of ``{input_name: array}`` dicts, or of arrays for a
    single-input model. Returns the int8 module (``main`` takes only the model inputs); the
    calibration result is attached as ``result.attrs["autoq.qparams"]`` (JSON text).

    With ``config.fallback = AutoFallback(...)`` the layers to keep in fp32 (or int16) are
    chosen automatically after calibration (see :mod:`autoq.analyze`); the decision is
    attached as ``result.attrs["autoq.fallback"]`` (JSON text, load it with
    ``autoq.FallbackDecision.loads``) and the result is realized with it as an ordinary
    ``Fallback(ids=...)`` / int16 overrides and the calibrated qparams.
    """
    config = config or Config()
    skipped: list[str] = []
    sim = None
    if config.skip_unbounded:
        sim = simulate(mod, params, config)
        config, skipped = skip_unbounded_layers(mod, params, dataset, config, target, sim=sim)
        if skipped:  # the new fallback changes the graph
            sim = None
    if isinstance(config.fallback, AutoFallback):
        from .analyze import auto_fallback

        final_cfg, qparams, decision, _report = auto_fallback(
            mod, params, dataset, config, target=target
        )
        out = realize(mod, params, qparams, final_cfg)
        out = out.with_attr("autoq.qparams", qparams.dumps())
        return out.with_attr("autoq.fallback", decision.dumps())
    if sim is None:
        sim = simulate(mod, params, config)
    qparams = calibrate(sim, params, dataset, config, target=target)
    out = realize(mod, params, qparams, config)
    if skipped:
        out = out.with_attr("autoq.skipped_unbounded", ",".join(skipped))
    return out.with_attr("autoq.qparams", qparams.dumps())


def skip_unbounded_layers(
    mod, params, dataset, config: Config, target=None, *, sim: SimResult | None = None
) -> tuple[Config, list[str]]:
    """``config`` with the layers reading or writing unbounded activations (attention masks
    of ``finfo.min``, see :mod:`autoq.guard`) added to its fallback ids, and those layers.
    ``sim``: ``simulate(mod, params, config)`` when the caller has it already."""
    if sim is None:
        sim = simulate(mod, params, config)
    bad = unbounded_slots(sim, dataset, target)
    layers = [x for x in layers_using(sim, bad) if x not in config.fallback.ids]
    if not layers:
        return config, []
    ranges = ", ".join(f"{s} [{lo:.3g}, {hi:.3g}]" for s, (lo, hi) in bad.items())
    warnings.warn(
        f"keeping {len(layers)} layer(s) in fp32 because their activations are unbounded "
        f"(masking constants?): {', '.join(layers)}; ranges: {ranges}. "
        "Set Config(skip_unbounded=False) to quantize them anyway.",
        stacklevel=3,
    )
    fb = dataclasses.replace(config.fallback, ids=(*config.fallback.ids, *layers))
    return config.replace(fallback=fb), layers
