"""Automatic fallback: find the fewest layers to keep in fp32 (or int16).

``Config(fallback=AutoFallback(...))`` makes the pipeline (:class:`autoq.pipeline.Quantizer`)
call :func:`auto_fallback` after calibration. :func:`search_fallback` ranks the layers by
their "alone" SQNR (or, ``ranking="revert"``, by the metric with that layer reverted to
fp32), then switches off the most sensitive ones, one after the other, in the compiled
simulated graph of an :class:`autoq.fallback.analysis.Analysis` until the metric meets the budget.
Since every layer exits as int8 (:mod:`autoq.rules.exits`), a layer kept in fp32 still reads the
int8 output of a layer that feeds it an int32 result; so a layer goes to fp32 *with* those
feeders (its group: ``c3`` with ``c2`` when ``c2``'s conv feeds ``c3``), and the budget
``max_fp32_layers`` counts every layer of the groups.
A trial is one run of that function over the calibration samples: no recalibration, no
recompilation. The chosen layers become an ordinary ``Fallback(ids=...)`` (or int16
overrides) with the calibrated qparams carried over (:func:`remap_qparams`).
With ``AutoFallback(holdout=n)`` the last ``n`` samples are calibrated on by nothing: a
group is kept only if it also raises the output SQNR on them (:func:`split_holdout`), so
the search cannot keep layers that only fit the calibration samples.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from autoq import primitives as P
from autoq.calibration import calibrate
from autoq.calibration.holdout import split_holdout
from autoq.config import AutoFallback, Config, Fallback, Override
from autoq.fallback.analysis import Analysis
from autoq.fallback.report import Report, fmt_db, json_float, json_num, sort_key
from autoq.ir.target import default_target
from autoq.json_document import JsonDocument
from autoq.metrics import sqnr_db
from autoq.qparams import QParam, QParams
from autoq.simulation import SimResult, simulate

__all__ = [
    "FallbackDecision",
    "FallbackOutcome",
    "auto_fallback",
    "remap_qparams",
    "search_fallback",
    "split_holdout",
]


@dataclass
class FallbackDecision(JsonDocument):
    """What :func:`search_fallback` chose and why.

    ``layers``: the layers kept out of int8 (most sensitive first), ``precision``: what they
    got (``fp32`` or ``int16``), ``met``: whether the budget was met, ``metric`` the final
    metric value and ``reference`` the fp32 one (``inf`` for SQNR), ``budget`` the
    condition in words, ``ranking`` every candidate with its score and reason, ``trials``
    one entry per evaluated fallback set (``k``, layers, metric), ``seconds`` the time of
    the ranking + search (``analysis_seconds``: compile + report)."""

    layers: list[str]
    precision: str
    met: bool
    metric_name: str
    metric: float
    reference: float
    budget: str
    ranking: list[dict]
    trials: list[dict]
    seconds: float
    analysis_seconds: float
    int16_metric: float | None = None
    #: runs of the model over the data: trials + the per-layer runs of ``ranking="revert"``
    evaluations: int = 0
    #: ``precision="int16_first"``: the layers given int16 activations (``layers``: fp32)
    int16_layers: list[str] = field(default_factory=list)

    def fallback(self, base: Fallback | None = None) -> Fallback:
        """The plain :class:`Fallback` that realizes this decision (``precision="fp32"``)."""
        base = base.fixed() if isinstance(base, AutoFallback) else (base or Fallback())
        if self.precision not in ("fp32", "int16_first"):
            return base
        return Fallback(
            tuple(base.ids) + tuple(self.layers), base.op_types, base.patterns, base.validate
        )

    def config(self, config: Config) -> Config:
        """``config`` with the decision applied (fallback ids or int16 overrides)."""
        overrides = tuple(config.overrides)
        if self.precision == "int16_tensors":
            tensors = (*config.int16_tensors, *self.layers)
            return config.replace(fallback=self.fallback(config.fallback), int16_tensors=tensors)
        if self.precision == "int16":
            overrides = _int16_overrides(config, self.layers)
        if self.precision == "int16_first":
            overrides = _int16_overrides(config, self.int16_layers)
        return config.replace(fallback=self.fallback(config.fallback), overrides=overrides)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("metric", "reference", "int16_metric"):
            d[k] = json_num(d[k])
        d["trials"] = [dict(t, metric=json_num(t["metric"])) for t in self.trials]
        d["ranking"] = [dict(r, score=json_num(r["score"])) for r in self.ranking]
        return d

    @classmethod
    def from_json(cls, d: dict) -> FallbackDecision:
        d = dict(d)
        for k in ("metric", "reference", "int16_metric"):
            d[k] = json_float(d.get(k))
        d["trials"] = [dict(t, metric=json_float(t["metric"])) for t in d["trials"]]
        d["ranking"] = [dict(r, score=json_float(r["score"])) for r in d["ranking"]]
        return cls(**d)

    def summary(self) -> str:
        what = "fp32" if self.precision in ("fp32", "int16_first") else "int16 activations"
        mixed = ""
        if self.precision == "int16_first":
            mixed = f"{len(self.int16_layers)} in int16: {', '.join(self.int16_layers) or '-'}, "
        lines = [
            f"{mixed}{len(self.layers)} layer(s) in {what}: {', '.join(self.layers) or '-'}; "
            f"{self.metric_name} {fmt_db(self.metric)} ({self.budget}: "
            f"{'met' if self.met else 'NOT met'}); {self.evaluations} runs, {self.seconds:.1f} s"
        ]
        for r in self.ranking[: max(len(self.layers), 1) + 2]:
            mark = "*" if r["layer"] in (*self.layers, *self.int16_layers) else " "
            lines.append(f" {mark} {r['layer']}: {r['reason']}")
        return "\n".join(lines)


def _int16_overrides(config: Config, layers: Sequence[str]) -> tuple[Override, ...]:
    """``config.overrides`` plus int16 activation overrides for ``layers``."""
    spec = config.activation.as_int16()
    return (*config.overrides, *(Override(layer, activation=spec) for layer in layers))


def _evaluator(an: Analysis, fb: AutoFallback, sqnr=None):
    """(name, reference, score(disabled_layers), within(score), budget text) for
    ``fb.metric``; ``sqnr(disabled)`` computes the SQNR metric elsewhere (the workers of a
    distributed run), the same value."""
    if fb.metric == "sqnr":
        ref_outs = None if sqnr is not None else an.run_fp32()

        def score_sqnr(disabled):
            return sqnr_db(ref_outs, an.run(disabled)) if sqnr is None else sqnr(disabled)

        return (
            "output SQNR (dB)",
            float("inf"),
            score_sqnr,
            lambda v: v >= fb.min_sqnr,
            f"SQNR >= {fb.min_sqnr:g} dB",
        )
    metric = fb.metric
    reference = float(metric(an.run_fp32))

    def score_user(disabled):
        return float(metric(an.runner(disabled)))

    return (
        getattr(metric, "__name__", "metric"),
        reference,
        score_user,
        lambda v: reference - v <= fb.max_drop,
        f"drop <= {fb.max_drop:g} from fp32 {reference:.6g}",
    )


def _group(an: Analysis, layer: str) -> list[str]:
    """``layer`` and the layers whose int32 result it reads: every layer exits as int8
    (autoq.rules.exits), so a layer in fp32 reads un-rounded inputs only if those go too."""
    return [layer, *an.feeders.get(layer, [])]


def _ranking(an: Analysis, report: Report, fb: AutoFallback, score, name: str, base: float):
    if fb.ranking != "revert":
        return [
            {
                "layer": s.layer,
                "score": s.sqnr_alone,
                "reason": f"SQNR {fmt_db(s.sqnr_alone)} dB when only this layer is quantized "
                f"(cos {s.cos_alone:.5f}); {fmt_db(s.sqnr_upstream)} dB with everything upstream",
            }
            for s in report.ranked()
        ]
    scored = [(s, score(_group(an, s.layer))) for s in report.layers]
    scored.sort(key=lambda t: (-sort_key(t[1]), t[0].index))  # most improvement first
    return [
        {
            "layer": s.layer,
            "score": v,
            "reason": f"{name} {fmt_db(v)} with {' + '.join(_group(an, s.layer))} in fp32 "
            f"(all int8: {fmt_db(base)}; its own SQNR {fmt_db(s.sqnr_alone)} dB)",
        }
        for s, v in scored
    ]


def _held_out_check(an: Analysis, held):
    """``gain(layers) -> (kept, sqnr)``: whether ``layers`` in fp32 raise the output SQNR on
    the ``held`` samples above the best kept so far (always kept without ``held``)."""
    if not held:
        return lambda layers: (True, None)
    ref = an.run_fp32(held)
    best = [sqnr_db(ref, an.run([], held))]

    def gain(layers):
        v = sqnr_db(ref, an.run(layers, held))
        if sort_key(v) > sort_key(best[0]):
            best[0] = v
            return True, v
        return False, v

    return gain


def _search(an: Analysis, ranking, fb: AutoFallback, trial, within, start, held):
    """Add the ranked layers' groups one by one (at most ``fb.max_fp32_layers`` layers; a
    group that does not raise the held-out SQNR is skipped) until the budget is met.
    Returns (layers, metric, met): the first set within budget, else the best trial."""
    gain = _held_out_check(an, held)
    (layers, value), chosen = start, []
    for layer in [r["layer"] for r in ranking]:
        new = [x for x in _group(an, layer) if x not in chosen]
        cand = chosen + new  # too big for what is left of the budget: try the next one
        if not new or len(cand) > fb.max_fp32_layers:
            continue
        v = trial(cand)
        kept, held_v = gain(cand)
        if held_v is not None:
            trial.trials[-1].update(held_out_sqnr=json_num(held_v), kept=kept)
        if not kept:
            continue
        chosen = cand
        if within(v):
            return cand, v, True
        if sort_key(v) > sort_key(value):
            layers, value = cand, v
    return layers, value, False


def search_fallback(
    an: Analysis, fb: AutoFallback, report: Report | None = None, sqnr=None, held=()
) -> FallbackDecision:
    """Rank the layers of ``an`` and find the fewest to keep in fp32 (module docstring).
    ``sqnr(disabled)``: the SQNR trials run elsewhere (see :func:`auto_fallback`); ``held``:
    held-out samples each kept layer group must improve (``AutoFallback.holdout``)."""
    t0 = time.perf_counter()
    report = report or an.report()
    name, reference, score, within, budget = _evaluator(an, fb, sqnr)
    trials: list[dict] = []

    def trial(layers: list[str]) -> float:
        v = score(layers)
        trials.append({"k": len(layers), "layers": list(layers), "metric": v, "met": within(v)})
        return v

    trial.trials = trials
    base = trial([])
    ranking = _ranking(an, report, fb, score, name, base)
    # the chosen fp32 set: the first within budget, else the best trial
    layers, value, met = [], base, within(base)
    if not met:
        layers, value, met = _search(an, ranking, fb, trial, within, (layers, value), held)
    if not met:
        warnings.warn(
            f"AutoFallback: {budget} not reached with up to {fb.max_fp32_layers} fp32 layers; "
            f"using the best trial ({len(layers)} layers, {name} {fmt_db(value)})",
            stacklevel=2,
        )
    return FallbackDecision(
        layers=layers,
        precision="fp32",
        met=met,
        metric_name=name,
        metric=value,
        reference=reference,
        budget=budget,
        ranking=ranking,
        trials=trials,
        seconds=time.perf_counter() - t0,
        analysis_seconds=an.timings.get("compile_s", 0.0) + an.timings.get("report_s", 0.0),
        evaluations=len(trials) + (len(report.layers) if fb.ranking == "revert" else 0),
    )


def remap_qparams(src: SimResult, qparams: QParams, dst: SimResult) -> QParams:
    """``qparams`` (calibrated for ``src``) re-keyed for ``dst``, the same model with
    other fallback/override choices: activation slots are matched by the tensor they
    quantize (a slot id can change when its producer layer falls back), weights by id.
    An activation slot whose dtype changed (an int16 override) gets qparams for the new
    dtype from the same calibrated range."""
    by_tensor = {src.graph.ids[t]: sid for sid, t in src.plan.tensors.items()}
    out: dict[str, QParam] = {}
    for sid, info in dst.slots.items():
        if info.kind == "weight":
            old = sid
        else:
            old = by_tensor.get(dst.graph.ids[dst.plan.tensors[sid]])
        if old is None or old not in qparams:
            raise KeyError(f"no calibrated qparams for slot {sid!r}")
        out[sid] = _as_slot(qparams[old], dst.plan.specs[sid], info.axis)
    meta = dict(qparams.meta)
    meta["specs"] = {s: sp.to_json() for s, sp in dst.plan.specs.items()}
    return QParams(out, dict(dst.slots), meta, _remap_values(src, qparams, dst, out))


def _as_slot(q: QParam, spec, axis: int | None) -> QParam:
    """``q`` for a slot of ``spec``'s dtype and channel ``axis`` (None: per tensor): the
    same calibrated range on the new dtype, a per-channel range's covering range when the
    slot is per tensor (its per-channel reader fell back: lookup inputs and depthwise inputs,
    :mod:`autoq.rules.lut_channels`, :mod:`autoq.rules.depthwise_channels`)."""
    per_tensor = axis is None and q.per_axis
    if spec.dtype == q.dtype and not per_tensor:
        return q
    lo = q.rmin if q.rmin is not None else P.dequantize(q.qmin, q.scale, q.zero_point)
    hi = q.rmax if q.rmax is not None else P.dequantize(q.qmax, q.scale, q.zero_point)
    if per_tensor:
        lo, hi = float(np.min(lo)), float(np.max(hi))
    return QParam.from_range(
        lo, hi, spec.dtype, spec.symmetric, spec.narrow_range, spec.reduce_range,
        axis=None if per_tensor else q.axis,
    )  # fmt: skip


def _remap_values(src: SimResult, qparams: QParams, dst: SimResult, out: dict) -> dict:
    """The integer weights / biases calibration chose (``Config.weight_rounding``,
    ``bias_correction``) for the layers still quantized in ``dst``; a corrected bias is
    re-quantized for ``dst``'s accumulator scale (an int16 override changes its input's)."""
    values = {}
    for key, v in qparams.values.items():
        layer = key.rsplit(".", 1)[0]
        if key in dst.slots:
            values[key] = v
        elif layer in dst.plan.biases and layer in src.plan.biases:
            _, x_sid, w_sid = dst.plan.biases[layer]
            b = src.value_input(key, qparams)
            values[key] = P.quantize_bias(b, out[x_sid].scale, out[w_sid].scale).values
    return values


@dataclass
class FallbackOutcome:
    """What :func:`auto_fallback` returns: the ``config`` to realize with (a plain
    ``Fallback`` / int16 overrides), its ``qparams``, the ``decision``, the ``report`` of the
    all-int8 model and the compiled ``analysis`` the search ran on (for more trials)."""

    config: Config
    qparams: QParams
    decision: FallbackDecision
    report: Report
    analysis: Analysis


def auto_fallback(
    model,
    params: dict | None,
    dataset,
    config: Config,
    qparams: QParams | None = None,
    target=None,
    fan_out=None,
) -> FallbackOutcome:
    """Run :class:`AutoFallback` end to end: calibrate (unless ``qparams`` are given),
    analyze, search, and (``precision="int16"``) check the int16 alternative.
    ``model``: the fp32 ``IRModule`` or its :class:`autoq.ir.matching.Matched` (reused, not
    matched again). ``fan_out(analysis) -> (report, sqnr)``: the report and the SQNR
    trials computed elsewhere with the same results (``autoq.distributed.AnalysisFanOut``)."""
    fb = config.fallback
    if not isinstance(fb, AutoFallback):
        raise TypeError("config.fallback must be an AutoFallback")
    target = target or default_target()
    base_cfg = config.replace(fallback=fb.fixed())
    dataset, held = split_holdout(dataset, fb.holdout)
    if qparams is None:
        sim = simulate(model, params, base_cfg)
        qparams = calibrate(sim, params, dataset, base_cfg, target=target)
    an = Analysis(model, params, dataset, qparams, base_cfg, target)
    report, sqnr = (an.report(), None) if fan_out is None else fan_out(an)
    decision = search_fallback(an, fb, report, sqnr, held)
    final_cfg, final_qp = decision.config(base_cfg), None
    if fb.precision == "int16" and decision.layers:
        final_cfg, final_qp = _try_int16(an, model, params, dataset, fb, decision, final_cfg)
    if final_qp is None:  # the switched graph has the same slots as the plain one
        final_qp = remap_qparams(an.sim, qparams, simulate(model, params, final_cfg))
    final_qp.meta["fallback"] = decision.to_json()
    return FallbackOutcome(final_cfg, final_qp, decision, report, an)


def _try_int16(an: Analysis, model, params, dataset, fb, decision, fp32_cfg):
    """The chosen layers with int16 activations instead of fp32: kept (and ``decision``
    updated) when that meets the budget, or beats the fp32 trial when neither does."""
    t0 = time.perf_counter()
    base_cfg = an.config
    cfg16 = base_cfg.replace(overrides=_int16_overrides(base_cfg, decision.layers))
    an16 = Analysis(
        model,
        params,
        dataset,
        lambda sim16: remap_qparams(an.sim, an.qparams, sim16),
        cfg16,
        an.target,
    )
    _name, _ref, score, within, _b = _evaluator(an16, fb)
    v16 = score([])
    ok16 = within(v16)
    decision.int16_metric = v16
    decision.evaluations += 1
    decision.trials.append(
        {"k": len(decision.layers), "layers": list(decision.layers), "metric": v16,
         "met": ok16, "precision": "int16"}
    )  # fmt: skip
    decision.seconds += time.perf_counter() - t0
    if ok16 or (not decision.met and sort_key(v16) >= sort_key(decision.metric)):
        decision.precision = "int16"
        decision.metric = v16
        decision.met = ok16
        return cfg16, an16.qparams
    return fp32_cfg, None
