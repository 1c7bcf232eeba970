"""The one quantization pipeline: every entry point (``autoq.quantize``, ``autoq quantize``,
the demo, the benchmarks) runs :class:`Quantizer`.

``Quantizer(config).run(mod, params, dataset)`` does, in order:

1. **match** the patterns once (:func:`autoq.ir.matching.match`); every later stage reuses it;
   a NaN/Inf weight is an error naming it (:func:`check_weights`);
2. read the **dataset** once into one validated, repeatable view
   (:func:`autoq.dataset.as_dataset`) that every stage iterates (integer inputs checked
   against the tables they index);
3. with ``Config.smooth_quant``, **SmoothQuant** rewrites the float model (LayerNorm output
   outliers into the dense weights, exact; :mod:`autoq.accuracy.smooth_quant`) and it is matched again;
4. the **unbounded-activation guard** (``Config.skip_unbounded``): layers touching attention
   masks of ``finfo.min`` stay fp32, with a warning (:mod:`autoq.fallback.guard`);
5. **calibrate** (:mod:`autoq.calibration`), or with ``Config(fallback=AutoFallback(...))``
   calibrate + analyze + search (:mod:`autoq.fallback.auto_fallback`); while a chosen activation
   scale cannot represent its own data (``Config.check_scales``, :mod:`autoq.calibration.scale_health`)
   the layers using it move to fp32, with a warning, and calibration runs again;
6. **realize** the int8 module (:mod:`autoq.realization`);
7. optionally the per-layer **report** (:mod:`autoq.fallback.analysis`).

With ``Config(activation=QuantSpec(dynamic=True))`` steps 2-5 and 7 do not run: the dense
layers are realized with run-time activation qparams (:mod:`autoq.realization.dynamic`), no dataset.

It returns a :class:`QuantizeResult`: the module, the qparams, the fallback decision, the
per-stage timings and every warning raised on the way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import tvm

from autoq.accuracy.smooth_quant import find_smoothable, smooth_graph
from autoq.build.module_check import check_builds
from autoq.calibration import (
    calibrate,
    feed_observers,
    fp32_slot_runner,
    samples_for,
    scale_problems,
)
from autoq.calibration.scale_health import HealthCheck
from autoq.config import AutoFallback, Config, Distributed, Resources
from autoq.config.progress import shown, status
from autoq.dataset import is_shard_source
from autoq.distributed import (
    PER_CHANNEL_RULES,
    AnalysisFanOut,
    calibrate_distributed,
    head_samples,
    open_client,
    report_distributed,
)
from autoq.errors import CalibrationError, InputError, SmoothQuantSkipped
from autoq.fallback.analysis import Analysis
from autoq.fallback.auto_fallback import FallbackDecision, auto_fallback, split_holdout
from autoq.fallback.escalation import escalate
from autoq.fallback.guard import keep_unbounded_in_fp32, layers_using
from autoq.fallback.int16_first import int16_first
from autoq.fallback.report import Report
from autoq.ir.matching import Matched, match
from autoq.ir.target import default_target
from autoq.qparams import QParams
from autoq.realization import realize
from autoq.realization.dynamic import realize_dynamic
from autoq.recipes import resolve
from autoq.rules.dynamic_lookups import REASON as LOOKUP_REASON
from autoq.rules.dynamic_lookups import lookups_between_dynamic
from autoq.simulation import simulate
from autoq.threads import one_thread

__all__ = ["QuantizeResult", "Quantizer", "check_scales", "quantize", "realize_like"]

_log = logging.getLogger("autoq")

#: ``AutoFallback.precision`` -> its search (the others: :func:`auto_fallback`)
SEARCHES = {"int16_tensors": escalate, "int16_first": int16_first}


@dataclass
class QuantizeResult:
    """What :meth:`Quantizer.run` produced.

    ``module``: the int8 IRModule (``main`` takes the model inputs; the qparams, the
    fallback decision and the unbounded layers are attached as ``attrs``). ``config``: the
    configuration that was realized (an ``AutoFallback`` replaced by the plain fallback it
    chose). ``matched``: the float model that was realized, after the exact rewrite of
    ``Config.smooth_quant``: simulate *it* with ``config``
    (``simulate(result.matched, None, result.config)``), not the input model.
    ``fp32_layers``: every layer left in fp32, with why. ``report``: the per-layer analysis
    when asked for (``Quantizer(report=True)``) or made by the automatic fallback.
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
    #: the LayerNorms ``Config.smooth_quant`` rewrote (empty: nothing applied)
    smoothed: tuple[str, ...] = ()
    #: (the recipe used, why): ``("transformer", "the model has a LayerNorm")``
    recipe: tuple[str, str] = ("", "")


class Quantizer:
    """simulate -> calibrate -> realize with the guard, the automatic fallback and the
    report (see the module docstring). ``config``: the quantization choices (default:
    ``Config()``, the recipe the model's structure calls for). ``target``: where calibration
    runs (default: this CPU). ``report``: also run the per-layer analysis on the calibration
    data. ``cluster``: calibrate on a Dask cluster (a ``dask.distributed.Client`` or a
    scheduler address; see :mod:`autoq.distributed`), like ``distributed=``.
    ``memory_budget_mb``, ``cache_dir``, ``progress``, ``distributed``: what the run may use
    (:class:`autoq.config.Resources`); they never change the result."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        target=None,
        report: bool = False,
        cluster=None,
        memory_budget_mb: float = 1024.0,
        cache_dir: str | None = None,
        progress: bool | None = None,
        distributed: Distributed | None = None,
    ):
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be an autoq.Config or None, got {type(config).__name__}")
        self.config = config or Config()
        self.resources = Resources(memory_budget_mb, cache_dir, progress, distributed)
        self.target = target or default_target()
        self.want_report = report
        self.cluster = cluster

    def run(self, mod: tvm.IRModule, params: dict | None, dataset) -> QuantizeResult:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # one_thread makes this thread's pool first (a TVM_NUM_THREADS capped to the CPUs:
            # in the warnings). Calibration runs its VMs and observers on threads of its own:
            # a pool of every core under each oversubscribes them (2 vCPUs, warm cache, same
            # hour: PP-OCRv4 det 104.2 CPU s with 2-thread pools, 85.9 with this); the model
            # runs on the whole pool afterwards
            with shown(self.resources.show_progress), one_thread():
                result = self._run(mod, params, dataset)
        for w in caught:  # re-raise for the caller's filters, after the run is complete
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        result.warnings = [str(w.message) for w in caught]
        return result

    def _client(self):
        """A Dask client for a distributed calibration, or a null context (in-process)."""
        if self.cluster is None and self.resources.distributed is None:
            return contextlib.nullcontext()
        return open_client(self.resources.distributed, self.cluster)

    def _fan_out(self, client, mod, params, samples):
        """The analysis and fallback trials on the workers, or None (in-process)."""
        if client is None:
            return contextlib.nullcontext()
        return AnalysisFanOut(client, mod, params, samples, resources=self.resources)

    def _calibrate(self, sim, samples, config: Config, client) -> QParams:
        if client is None:
            return calibrate(
                sim, None, samples, config, target=self.target, resources=self.resources
            )
        return calibrate_distributed(sim, samples, config, self.target, client, self.resources)

    def _data(self, dataset, graph, distributed: bool):
        """The validated dataset (integer inputs checked against the tables they index), or
        a shard source as it is (read by the workers)."""
        if not is_shard_source(dataset):
            return samples_for(dataset, graph.inputs, module=graph.module)
        if not distributed:
            raise ValueError(
                f"the dataset {dataset.describe()} is read by the workers of a distributed "
                "calibration: give Quantizer(distributed=Distributed(...)) or cluster=..."
            )
        fb = self.config.fallback
        if isinstance(fb, AutoFallback):  # what runs on the workers: SQNR trials, the report
            needs = {
                "metric=<callable>": callable(fb.metric),
                f"precision={fb.precision!r}": fb.precision != "fp32",
                f"holdout={fb.holdout}": fb.holdout > 0,
            }
            bad = [k for k, v in needs.items() if v]
            if bad:
                raise ValueError(
                    f"AutoFallback({', '.join(bad)}) needs the samples in this process too: "
                    f"give the dataset itself instead of {dataset.describe()}, or use "
                    "the default metric='sqnr', precision='fp32', holdout=0"
                )
        return dataset

    def _run(self, mod, params, dataset) -> QuantizeResult:
        config, why = resolve(self.config, mod, params)
        if config.activation.dynamic:
            result = self._run_dynamic(mod, params, config)
        else:
            with self._client() as client:
                if client is not None:
                    config = self._rules_for_a_cluster(config)
                result = self._run_on(mod, params, dataset, client, config)
        result.recipe = (config.recipe, why)
        if not result.int8_layers:
            warn_nothing_quantized(result.fp32_layers)
        with _Clock(result.timings)("build_check"):
            check_builds(result.module)  # never hand back a module that does not build
        return result

    def _rules_for_a_cluster(self, config: Config) -> Config:
        """A recipe's per-channel rules cannot be calibrated on a cluster (its workers'
        statistics are per tensor): left out with a warning when the recipe chose them, an
        error naming them when the user did (``Config.rules``)."""
        used = [r for r in PER_CHANNEL_RULES if config.has_rule(r)]
        if not used or self.config.rules is not None:
            return config  # none, or the user's own choice: calibrate_distributed says why
        warnings.warn(
            f"the {config.recipe} recipe's per-channel rules {used} do not run on a cluster "
            "(the workers' statistics are per tensor): calibrating without them; calibrate "
            "in-process for the recipe's full accuracy",
            stacklevel=4,
        )
        return config.replace(rules=tuple(r for r in config.rules if r not in used))

    def _run_on(self, mod, params, dataset, client, config: Config) -> QuantizeResult:
        timings: dict[str, float] = {}
        clock = _Clock(timings)
        with clock("match"):
            matched = match(mod, params, config)
            clock.detail = f"{len(matched.layers)} layers"
            check_weights(matched.graph.params)

            matched.active(config.fallback)  # fallback rules checked before any data work
            samples = self._data(dataset, matched.graph, client is not None)
        model, smoothed = (mod, params), ()  # the float model realized
        if config.smooth_quant is not None:
            with clock("smooth_quant"):
                matched, model, smoothed = self._smooth(matched, model, samples, config)
        reasons = {x: "fallback rule" for x in matched.kept_float(config.fallback)}
        between = lookups_between_dynamic(matched, config)  # autoq.rules.dynamic_lookups
        if between:
            fb = config.fallback
            config = config.replace(fallback=dataclasses.replace(fb, ids=(*fb.ids, *between)))
            reasons.update(dict.fromkeys(between, LOOKUP_REASON))
        sim = None
        if config.skip_unbounded:
            with clock("guard"):
                sim = simulate(matched, None, _fixed(config))
                head = head_samples(samples, matched.graph.inputs)
                guard_stats: dict = {}
                # in-process topological calibration compiles the guard's module again:
                # shared, it is one compile (then a compile-cache hit)
                shared = client is None and config.calibration != "fp32"
                config, skipped = keep_unbounded_in_fp32(
                    sim, head, config, self.target, guard_stats, shared
                )
            if "compile_s" in guard_stats:  # the one-off compile, listed apart by benchmarks
                timings["guard.compile"] = guard_stats["compile_s"]
            reasons.update(dict.fromkeys(skipped, "unbounded activations (guard)"))
            if skipped:  # the new fallback changes the simulated graph
                sim = None
        decision = report = analysis = None
        if isinstance(config.fallback, AutoFallback):
            with clock("calibrate"):
                calib, _ = split_holdout(samples, config.fallback.holdout)
                config, qparams, unusable = self._calibrate_healthy(
                    matched, sim, calib, config, client
                )
            reasons.update(dict.fromkeys(unusable, "unusable scale (scale health)"))
            search = SEARCHES.get(config.fallback.precision, auto_fallback)
            with clock("auto_fallback"), self._fan_out(client, *model, calib) as fan:
                out = search(
                    matched, None, samples, config, qparams, target=self.target, fan_out=fan
                )
            config, qparams, decision = out.config, out.qparams, out.decision
            report, analysis = out.report, out.analysis
            reasons.update(dict.fromkeys(decision.layers, f"automatic ({decision.precision})"))
            if decision.precision not in ("fp32", "int16_first"):
                reasons = {k: v for k, v in reasons.items() if k not in decision.layers}
        else:
            with clock("calibrate"):
                config, qparams, unusable = self._calibrate_healthy(
                    matched, sim, samples, config, client
                )
            reasons.update(dict.fromkeys(unusable, "unusable scale (scale health)"))
        _log.info("calibrated on %d samples", qparams.meta.get("samples") or 0)
        tuning = qparams.meta.get("weight_tuning")
        if tuning:  # part of "calibrate", shown on its own
            timings["calibrate.weight_tuning"] = tuning["tune_s"]
        with clock("realize"):
            module = realize(matched, None, qparams, config)
            clock.detail = f"{len(matched.active(config.fallback))} int8 layers"
        if self.want_report and report is None:
            with clock("report"):
                analysis = Analysis(matched, None, samples, qparams, config, self.target)
                if client is None:
                    report = analysis.report(progress=self.resources.show_progress)
                    clock.detail = f"{report.samples} samples"
                else:  # the samples' work on the workers, the same report
                    report = report_distributed(
                        analysis, *model, samples, client, resources=self.resources
                    )
        module = _attach(module, qparams, decision, [k for k, v in reasons.items() if "guard" in v])
        int8 = [m.layer for m in matched.active(config.fallback)]
        return QuantizeResult(
            module, qparams, config, matched, int8, reasons, decision, report, analysis,
            samples=qparams.meta.get("samples") or 0, timings=timings, smoothed=smoothed,
        )  # fmt: skip

    def _smooth(self, matched, model, samples, config: Config):
        """SmoothQuant on the float model (:mod:`autoq.accuracy.smooth_quant`), matched again:
        ``(matched, (mod, params), smoothed LayerNorms)`` of the rewritten model (what
        the workers of a cluster and every later stage quantize). Unchanged, silently, when
        no LayerNorm feeds a dense layer (a CNN); unchanged with a
        :class:`autoq.errors.SmoothQuantSkipped` warning when the samples are read only by a
        cluster's workers (the channel maxima are measured in this process)."""
        if not find_smoothable(matched.graph):
            return matched, model, ()
        if is_shard_source(samples):
            warnings.warn(
                SmoothQuantSkipped(
                    f"Config.smooth_quant skipped: the dataset {samples.describe()} is read "
                    "only by the workers and SmoothQuant measures its channel maxima in this "
                    "process; give the samples themselves to smooth, or set smooth_quant=None"
                ),
                stacklevel=4,
            )
            return matched, model, ()
        if isinstance(config.fallback, AutoFallback):  # held-out samples stay unseen
            samples, _ = split_holdout(samples, config.fallback.holdout)
        mod, params, plans = smooth_graph(matched.graph, samples, config.smooth_quant, self.target)
        return match(mod, params, config), (mod, params), tuple(p.ln.name for p in plans)

    def _calibrate_healthy(self, matched, sim, samples, config, client):
        """Calibrate; while some chosen activation scale is unusable on its own data (see
        :mod:`autoq.calibration.scale_health`), keep the layers reading or writing it in fp32 (with a
        warning naming them) and calibrate again. Returns (config, qparams, those layers)."""
        moved: list[str] = []
        while True:
            if sim is None:
                sim = simulate(matched, None, _fixed(config))
            qparams = self._calibrate(sim, samples, _fixed(config), client)
            bad = qparams.meta.get("scale_problems", {}) if config.check_scales else {}
            layers = [x for x in layers_using(sim, bad) if x not in config.fallback.ids]
            if not layers:
                return config, qparams, moved
            wide = _widen_bad_slots(config, bad)
            if wide is not None:
                config, sim = wide, None
                continue
            warnings.warn(
                f"keeping {len(layers)} layer(s) in fp32 because a chosen int8 scale cannot "
                f"represent their calibration data: {', '.join(layers)}; "
                + "; ".join(f"slot {s}: {why}" for s, why in bad.items())
                + " (Config(check_scales=False) quantizes them anyway).",
                stacklevel=4,
            )
            fb = config.fallback
            config = config.replace(fallback=dataclasses.replace(fb, ids=(*fb.ids, *layers)))
            moved += layers
            sim = None

    def _run_dynamic(self, mod, params, config: Config) -> QuantizeResult:
        """Dynamic activations (:mod:`autoq.realization.dynamic`): match and realize, no data."""
        timings: dict[str, float] = {}
        clock = _Clock(timings)
        with clock("match"):
            matched = match(mod, params, config)
        with clock("realize"):
            module, qparams, reasons = realize_dynamic(matched, config)
        module = _attach(module, qparams, None, [])
        int8 = [m for m in matched.layers if m not in reasons]
        return QuantizeResult(module, qparams, config, matched, int8, reasons, timings=timings)


def warn_nothing_quantized(fp32_layers: dict[str, str]) -> None:
    """No layer is left in int8 (no quantizable layer, or every one kept in fp32): the
    result is the float model, said in a warning naming why."""
    if not fp32_layers:
        why = "none of the model's ops matches a pattern autoq quantizes"
    else:
        by_reason: dict[str, list[str]] = {}
        for layer, reason in fp32_layers.items():
            by_reason.setdefault(reason, []).append(layer)
        why = (
            f"all {len(fp32_layers)} layer(s) are kept in fp32 ("
            + "; ".join(
                f"{r}: {', '.join(ls[:5])}{', ...' if len(ls) > 5 else ''}"
                for r, ls in by_reason.items()
            )
            + ")"
        )
    warnings.warn(f"no layer is quantized: {why}; the result is the fp32 model", stacklevel=4)


def _widen_bad_slots(config: Config, bad: dict) -> Config | None:
    """With ``AutoFallback(precision="int16_tensors")`` an unusable int8 scale is a tensor
    for int16 (it counts against ``max_int16_fraction``), not a reason for fp32 layers: the
    config with ``bad``'s 8-bit slots in ``int16_tensors`` (None otherwise / if none left)."""
    fb = config.fallback
    if not (isinstance(fb, AutoFallback) and fb.precision == "int16_tensors"):
        return None
    new = [s for s in bad if s not in config.int16_tensors]
    if not new:
        return None
    warnings.warn(
        f"int16 for {len(new)} tensor(s) whose int8 scale cannot represent their calibration "
        "data: " + "; ".join(f"{s}: {bad[s]}" for s in new),
        stacklevel=5,
    )
    return config.replace(int16_tensors=(*config.int16_tensors, *new))


def check_weights(weights: dict) -> None:
    """A NaN or Inf in a float weight is an :class:`autoq.errors.InputError` naming the
    weight (before any compile; the guard would otherwise keep its layer in fp32 silently)."""
    for name, w in weights.items():
        w = np.asarray(w)
        if np.issubdtype(w.dtype, np.inexact) and not np.all(np.isfinite(w)):
            n_nan = int(np.isnan(w).sum())
            first = np.argwhere(~np.isfinite(w))[0].tolist()
            raise InputError(
                f"weight {name!r} {tuple(w.shape)} contains {n_nan} NaN and "
                f"{int((~np.isfinite(w)).sum()) - n_nan} Inf value(s) (first at index {first}): "
                "the model's weights are corrupt; fix or re-export the model"
            )


def _fixed(config: Config) -> Config:
    """``config`` with an ``AutoFallback`` replaced by its fixed rules."""
    fb = config.fallback
    return config.replace(fallback=fb.fixed()) if isinstance(fb, AutoFallback) else config


def realize_like(result: QuantizeResult, mod: tvm.IRModule, params: dict | None) -> tvm.IRModule:
    """The int8 module of ``result`` for another import of the same model with other static
    input shapes (``mod, params``: e.g. ``from_onnx`` with another batch size): the same
    qparams, fallback and rules (layer ids and slots do not depend on the shapes), realized
    on ``mod``. A model that ``Config.smooth_quant`` rewrote is refused (the rewrite is of
    the calibrated import): an :class:`autoq.errors.InputError`."""
    from autoq.errors import InputError

    if result.smoothed:
        raise InputError(
            f"the model was rewritten by SmoothQuant ({len(result.smoothed)} LayerNorms): its "
            "int8 form cannot be realized on another import; quantize the model at the input "
            "shapes it will run with, or set Config(smooth_quant=None)"
        )
    config = result.config
    if config.activation.dynamic:
        module, qparams, _ = realize_dynamic(match(mod, params, config), config)
        return _attach(module, qparams, None, [])
    skipped = [k for k, v in result.fp32_layers.items() if "guard" in v]
    module = realize(mod, params, result.qparams, config)
    return _attach(module, result.qparams, result.decision, skipped)


def _attach(module, qparams: QParams, decision, skipped: list[str]) -> tvm.IRModule:
    module = module.with_attr("autoq.qparams", qparams.dumps())
    if decision is not None:
        module = module.with_attr("autoq.fallback", decision.dumps())
    if skipped:
        module = module.with_attr("autoq.skipped_unbounded", ",".join(skipped))
    return module


class _Clock:
    """``with clock("stage"):`` adds the block's wall time to ``timings["stage"]``, logs it
    (with ``detail``) and, in a shown run, draws the stage's live status meanwhile
    (:func:`autoq.config.progress.status`: erased before the stage line is logged)."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings
        self._stage = ""
        self._t0 = 0.0
        self._status = contextlib.ExitStack()
        self.detail = ""

    def __call__(self, stage: str) -> _Clock:
        self._stage = stage
        self.detail = ""  # what the stage counted, logged with its time
        return self

    def __enter__(self):
        _log.debug("%s ...", self._stage)
        self._t0 = time.perf_counter()
        self._status.enter_context(status(self._stage))

    def __exit__(self, *exc):
        self._status.close()
        dt = time.perf_counter() - self._t0
        self.timings[self._stage] = self.timings.get(self._stage, 0.0) + dt
        if exc[0] is None:
            _log.info(f"{self._stage:<14} {dt:6.1f} s  {self.detail}".rstrip())
        return False


def check_scales(
    mod: tvm.IRModule | Matched,
    params: dict | None,
    qparams: QParams,
    dataset,
    config=None,
    target=None,
) -> None:
    """Refuse qparams (a hand-edited or loaded file) whose activation scales cannot represent
    ``dataset``: :class:`autoq.errors.CalibrationError` naming every such slot, with the
    fraction of its fp32 values that round to the zero point or fall outside the grid (see
    :mod:`autoq.calibration.scale_health`). ``mod``: the float model the qparams were calibrated on;
    with SmoothQuant that is the rewritten one, ``QuantizeResult.matched`` (an input model
    with LayerNorms SmoothQuant rewrites is an :class:`autoq.errors.InputError`)."""
    matched = mod if isinstance(mod, Matched) else match(mod, params, config or Config())
    config = resolve(config, matched.graph)[0]
    if matched is not mod and config.smooth_quant is not None and find_smoothable(matched.graph):
        raise InputError(
            "check_scales: Config.smooth_quant rewrites this model's LayerNorms before "
            "calibration, so its qparams belong to the rewritten model: pass "
            "QuantizeResult.matched as the model (params=None)"
        )
    sim = simulate(matched, None, _fixed(config))
    slots = [s for s in sim.activation_slots() if s in qparams]
    run = fp32_slot_runner(sim, slots, target or default_target())
    checks = feed_observers(
        [HealthCheck(qparams[s]).observer() for s in slots],
        run(samples_for(dataset, sim.graph.inputs)),
    )
    health = {s: o.compute() for s, o in zip(slots, checks, strict=True)}
    bad = scale_problems(health, qparams, sim, config)
    if bad:
        raise CalibrationError(
            "the qparams do not fit the data: "
            + "; ".join(f"slot {s!r}: {why}" for s, why in bad.items())
            + " (fix the scale in the qparams file or calibrate again)"
        )


def quantize(
    mod: tvm.IRModule,
    params: dict | None,
    dataset,
    config: Config | None = None,
    target=None,
    cluster=None,
    **resources,
) -> tvm.IRModule:
    """Quantize an fp32 Relax module with a representative dataset: the int8 module of
    ``Quantizer(config, target=target).run(mod, params, dataset)``.

    ``params``: weight arrays by function-parameter name (None when the weights are bound as
    constants). ``dataset``: an iterable of ``{input_name: array}`` dicts, or of arrays for a
    single-input model (read once); None with dynamic activations (``Config(activation=
    QuantSpec(dynamic=True))``, see :mod:`autoq.realization.dynamic`). Returns the int8 module (``main`` takes only the model
    inputs); the calibration result is attached as ``result.attrs["autoq.qparams"]`` (JSON
    text), an automatic fallback decision as ``result.attrs["autoq.fallback"]`` (load it with
    ``autoq.FallbackDecision.loads``) and the layers the unbounded-activation guard kept in
    fp32 as ``result.attrs["autoq.skipped_unbounded"]``. ``cluster``: calibrate on a Dask
    cluster (a ``dask.distributed.Client`` or a scheduler address, see
    :mod:`autoq.distributed`; ``dataset`` may then be a shard source the workers read).
    ``resources``: ``memory_budget_mb``, ``cache_dir``, ``progress``, ``distributed`` (see
    :class:`Quantizer`).
    """
    quantizer = Quantizer(config, target=target, cluster=cluster, **resources)
    return quantizer.run(mod, params, dataset).module
