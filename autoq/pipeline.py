"""The one quantization pipeline: every entry point (``autoq.quantize``, ``autoq quantize``,
the demo, the benchmarks) runs :class:`Quantizer`.

``Quantizer(config).run(mod, params, dataset)`` does, in order:

1. **match** the patterns once (:func:`autoq.matching.match`); every later stage reuses it;
2. read the **dataset** once into one validated, repeatable view
   (:func:`autoq.dataset.as_dataset`) that every stage iterates;
3. the **unbounded-activation guard** (``Config.skip_unbounded``): layers touching attention
   masks of ``finfo.min`` stay fp32, with a warning (:mod:`autoq.guard`);
4. **calibrate** (:mod:`autoq.calibrate`), or with ``Config(fallback=AutoFallback(...))``
   calibrate + analyze + search (:mod:`autoq.auto_fallback`);
5. **realize** the int8 module (:mod:`autoq.realize`);
6. optionally the per-layer **report** (:mod:`autoq.analysis`).

With ``Config(activation=QuantSpec(dynamic=True))`` steps 2-4 and 6 do not run: the dense
layers are realized with run-time activation qparams (:mod:`autoq.dynamic`), no dataset.

It returns a :class:`QuantizeResult`: the module, the qparams, the fallback decision, the
per-stage timings and every warning raised on the way.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import tvm

from .analysis import Analysis
from .auto_fallback import FallbackDecision, auto_fallback
from .build import default_target
from .calibrate import calibrate, samples_for
from .config import AutoFallback, Config
from .dynamic import realize_dynamic
from .guard import keep_unbounded_in_fp32
from .matching import Matched, match
from .qparams import QParams
from .realize import realize
from .report import Report
from .simulate import simulate

__all__ = ["QuantizeResult", "Quantizer", "quantize"]


@dataclass
class QuantizeResult:
    """What :meth:`Quantizer.run` produced.

    ``module``: the int8 IRModule (``main`` takes the model inputs; the qparams, the
    fallback decision and the unbounded layers are attached as ``attrs``). ``config``: the
    configuration that was realized (an ``AutoFallback`` replaced by the plain fallback it
    chose). ``fp32_layers``: every layer left in fp32, with why. ``report``: the per-layer
    analysis when asked for (``Quantizer(report=True)``) or made by the automatic fallback.
    ``timings``: seconds per stage. ``warnings``: the text of every warning raised."""

    module: tvm.IRModule
    qparams: QParams
    config: Config
    matched: Matched
    int8_layers: list[str]
    fp32_layers: dict[str, str]
    decision: FallbackDecision | None = None
    report: Report | None = None
    #: the compiled per-layer analysis behind ``report`` (run more trials on it)
    analysis: Analysis | None = None
    samples: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class Quantizer:
    """simulate -> calibrate -> realize with the guard, the automatic fallback and the
    report (see the module docstring). ``target``: where calibration runs (default: this
    CPU). ``report``: also run the per-layer analysis on the calibration data."""

    def __init__(self, config: Config | None = None, *, target=None, report: bool = False):
        self.config = config or Config()
        self.target = target or default_target()
        self.want_report = report

    def run(self, mod: tvm.IRModule, params: dict | None, dataset) -> QuantizeResult:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = self._run(mod, params, dataset)
        for w in caught:  # re-raise for the caller's filters, after the run is complete
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        result.warnings = [str(w.message) for w in caught]
        return result

    def _run(self, mod, params, dataset) -> QuantizeResult:
        if self.config.activation.dynamic:
            return self._run_dynamic(mod, params)
        timings: dict[str, float] = {}
        clock = _Clock(timings)
        config = self.config
        with clock("match"):
            matched = match(mod, params, config)
            matched.active(config.fallback)  # fallback rules checked before any data work
            samples = samples_for(dataset, matched.graph.inputs)
        reasons = {x: "fallback rule" for x in matched.kept_float(config.fallback)}
        sim = None
        if config.skip_unbounded:
            with clock("guard"):
                sim = simulate(matched, None, _fixed(config))
                config, skipped = keep_unbounded_in_fp32(sim, samples, config, self.target)
            reasons.update(dict.fromkeys(skipped, "unbounded activations (guard)"))
            if skipped:  # the new fallback changes the simulated graph
                sim = None
        decision = report = analysis = None
        if isinstance(config.fallback, AutoFallback):
            with clock("calibrate"):
                if sim is None:
                    sim = simulate(matched, None, _fixed(config))
                qparams = calibrate(sim, None, samples, _fixed(config), target=self.target)
            with clock("auto_fallback"):
                out = auto_fallback(matched, None, samples, config, qparams, target=self.target)
            config, qparams, decision = out.config, out.qparams, out.decision
            report, analysis = out.report, out.analysis
            reasons.update(dict.fromkeys(decision.layers, f"automatic ({decision.precision})"))
            if decision.precision != "fp32":
                reasons = {k: v for k, v in reasons.items() if k not in decision.layers}
        else:
            with clock("calibrate"):
                if sim is None:
                    sim = simulate(matched, None, config)
                qparams = calibrate(sim, None, samples, config, target=self.target)
        with clock("realize"):
            module = realize(matched, None, qparams, config)
        if self.want_report and report is None:
            with clock("report"):
                analysis = Analysis(matched, None, samples, qparams, config, self.target)
                report = analysis.report()
        module = _attach(module, qparams, decision, [k for k, v in reasons.items() if "guard" in v])
        int8 = [m.layer for m in matched.active(config.fallback)]
        return QuantizeResult(
            module, qparams, config, matched, int8, reasons, decision, report, analysis,
            samples=samples.num_samples or 0, timings=timings,
        )  # fmt: skip

    def _run_dynamic(self, mod, params) -> QuantizeResult:
        """Dynamic activations (:mod:`autoq.dynamic`): match and realize, no data."""
        timings: dict[str, float] = {}
        clock = _Clock(timings)
        with clock("match"):
            matched = match(mod, params, self.config)
        with clock("realize"):
            module, qparams, reasons = realize_dynamic(matched, self.config)
        module = _attach(module, qparams, None, [])
        int8 = [m for m in matched.layers if m not in reasons]
        return QuantizeResult(module, qparams, self.config, matched, int8, reasons, timings=timings)


def _fixed(config: Config) -> Config:
    """``config`` with an ``AutoFallback`` replaced by its fixed rules."""
    fb = config.fallback
    return config.replace(fallback=fb.fixed()) if isinstance(fb, AutoFallback) else config


def _attach(module, qparams: QParams, decision, skipped: list[str]) -> tvm.IRModule:
    module = module.with_attr("autoq.qparams", qparams.dumps())
    if decision is not None:
        module = module.with_attr("autoq.fallback", decision.dumps())
    if skipped:
        module = module.with_attr("autoq.skipped_unbounded", ",".join(skipped))
    return module


class _Clock:
    """``with clock("stage"):`` adds the block's wall time to ``timings["stage"]``."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self._stage = ""
        self._t0 = 0.0

    def __call__(self, stage: str) -> _Clock:
        self._stage = stage
        return self

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t0
        self.timings[self._stage] = self.timings.get(self._stage, 0.0) + dt
        return False


def quantize(
    mod: tvm.IRModule, params: dict | None, dataset, config: Config | None = None, target=None
) -> tvm.IRModule:
    """Quantize an fp32 Relax module with a representative dataset: the int8 module of
    ``Quantizer(config, target=target).run(mod, params, dataset)``.

    ``params``: weight arrays by function-parameter name (None when the weights are bound as
    constants). ``dataset``: an iterable of ``{input_name: array}`` dicts, or of arrays for a
    single-input model (read once); None with dynamic activations (``Config(activation=
    QuantSpec(dynamic=True))``, see :mod:`autoq.dynamic`). Returns the int8 module (``main`` takes only the model
    inputs); the calibration result is attached as ``result.attrs["autoq.qparams"]`` (JSON
    text), an automatic fallback decision as ``result.attrs["autoq.fallback"]`` (load it with
    ``autoq.FallbackDecision.loads``) and the layers the unbounded-activation guard kept in
    fp32 as ``result.attrs["autoq.skipped_unbounded"]``.
    """
    return Quantizer(config, target=target).run(mod, params, dataset).module
