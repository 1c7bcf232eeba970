"""Fallback search that tries int16 before fp32, layer by layer.

``Config(fallback=AutoFallback(precision="int16_first", max_fp32_layers=3))``: after
calibration, :func:`int16_first` ranks the layers by their effect on the model's output
metric (``ranking="revert"``: one trial per layer, that layer's activations int16 with every
other layer int8; ``"local"``: the lowest int8 SQNR of the layer's own activation tensors,
free), then walks the ranking: each layer is first tried with int16 activations
(``Override(layer, activation=int16)``: the activation tensors it quantizes become int16,
its weights stay int8) and only when that does not help in fp32 (with the layers whose int32
result it reads, as :mod:`autoq.fallback.auto_fallback` does). A step is kept only if it raises the
metric on the calibration samples *and*, with ``AutoFallback.holdout``, the output SQNR on
the held-out samples; the walk stops when the metric meets the budget or
``max_fp32_layers`` layers (int16 and fp32 together) are above int8, or after the first
:data:`WALK` x ``max_fp32_layers`` ranked layers.

**One compile for the whole search.** The trials run on an
:class:`autoq.fallback.escalation.EscalationGraph` built on the simulated graph *with layer switches*
(as :class:`autoq.fallback.analysis.Analysis` simulates it): every activation tensor has a runtime
int16 switch and every layer a runtime fp32 switch, so any mix is one run, no recompiling.
int16 qparams come from the tensor's observed range (:func:`autoq.fallback.escalation.int16_qparam`),
and the realized model gets exactly those (:func:`autoq.fallback.auto_fallback.remap_qparams`).

Why (PP-OCRv4 det, 320x320, 16 calibration / 16 evaluation images): every activation int16
gives IoU@0.3 99.2% against 90.8% all int8, and the best single tensor in int16 93.5%:
the error is spread over the activations, and int16 on a layer's inputs removes most of
it at a fraction of fp32's cost (its weights and kernels stay integer).
"""

from __future__ import annotations

import math
import time
import warnings

from autoq.calibration import calibrate
from autoq.config import AutoFallback, Config
from autoq.fallback.analysis import layer_feeders
from autoq.fallback.auto_fallback import FallbackDecision, FallbackOutcome, remap_qparams
from autoq.fallback.escalation import EscalationGraph, requantized_biases, search_setup, trial_set
from autoq.fallback.report import fmt_db, json_num, sort_key
from autoq.metrics import sqnr_db
from autoq.qparams import QParams
from autoq.simulation import simulate

#: the walk tries at most WALK x ``max_fp32_layers`` ranked layers (when nothing helps, it
#: would otherwise cost two trials per layer of the model)
WALK = 4

__all__ = ["apply_decision", "int16_first", "int16_first_search", "layer_int16_slots"]


def layer_int16_slots(eg: EscalationGraph) -> dict[str, list[str]]:
    """Layer -> the activation slots it quantizes (what ``Override(layer, activation=int16)``
    makes int16), for the layers whose slots all have an int16 switch in ``eg``."""
    sim, cand = eg.sim, set(eg.candidates)
    owned: dict[str, list[str]] = {}
    for sid in sim.activation_slots():
        owned.setdefault(sim.slots[sid].layer, []).append(sid)
    return {k: v for k, v in owned.items() if k and all(s in cand for s in v)}


class _Trials:
    """The metric of (fp32 layers, int16 layers) on the calibration samples (logged), and
    the held-out check (``gain``)."""

    def __init__(self, eg: EscalationGraph, fb: AutoFallback, slots: dict, held):
        self.eg, self.slots, self.fb = eg, slots, fb
        self.log: list[dict] = []
        if fb.metric == "sqnr":
            ref = eg.run_fp32()
            self.name, self.reference = "output SQNR (dB)", math.inf
            self.score = lambda f, s: sqnr_db(ref, self.run(f, s))
            self.budget = f"SQNR >= {fb.min_sqnr:g} dB"
        else:
            self.name = getattr(fb.metric, "__name__", "metric")
            self.reference = float(fb.metric(eg.run_fp32))
            self.score = lambda f, s: float(fb.metric(eg.runner(self.selected(s), f)))
            self.budget = f"drop <= {fb.max_drop:g} from fp32 {self.reference:.6g}"
        self.held = list(held)
        if self.held:
            self._held_ref = eg.run_fp32(self.held)
            self._held_best = sqnr_db(self._held_ref, eg.run([], self.held))

    def within(self, v: float) -> bool:
        if self.fb.metric == "sqnr":
            return v >= self.fb.min_sqnr
        return self.reference - v <= self.fb.max_drop

    def selected(self, int16_layers) -> list[str]:
        return [s for layer in int16_layers for s in self.slots[layer]]

    def run(self, fp32, int16, samples=None):
        return self.eg.run(self.selected(int16), samples, disabled=fp32)

    def __call__(self, fp32: list, int16: list, kind: str) -> float:
        v = self.score(list(fp32), list(int16))
        self.log.append(
            {"k": len(fp32) + len(int16), "layers": list(fp32), "int16_layers": list(int16),
             "metric": v, "met": self.within(v), "kind": kind}
        )  # fmt: skip
        return v

    def gain(self, fp32, int16) -> bool:
        """Whether the held-out output SQNR beats the best kept so far (recorded in the
        last trial); True without held-out samples."""
        if not self.held:
            return True
        v = sqnr_db(self._held_ref, self.run(fp32, int16, self.held))
        kept = v > self._held_best
        self._held_best = max(v, self._held_best)
        self.log[-1].update(held_out_sqnr=json_num(v), kept=kept)
        return kept


def _rank(eg: EscalationGraph, fb: AutoFallback, trials: _Trials, layers, feeders) -> list:
    """Ranked candidates (best first): ``{"layer", "score", "reason"}``."""
    if fb.ranking == "local":
        own = {k: min(eg.local_sqnr[s] for s in v) for k, v in trials.slots.items()}
        ranked = sorted(layers, key=lambda x: (sort_key(own.get(x, math.inf)), layers.index(x)))
        return [
            {"layer": x, "score": own.get(x, math.inf),
             "reason": f"lowest own int8 SQNR of its activations {fmt_db(own.get(x, math.inf))} dB"}
            for x in ranked
        ]  # fmt: skip
    some = trial_set(eg)
    ref = eg.run_fp32(some)
    out = []
    for x in layers:  # its effect on the output: int16 if it can be, else fp32 (its group)
        if x in trials.slots:
            v, how = sqnr_db(ref, eg.run(trials.selected([x]), some)), "int16 activations"
        else:
            group = [x, *feeders.get(x, [])]
            v, how = sqnr_db(ref, eg.run([], some, disabled=group)), "fp32 " + "+".join(group)
        out.append({"layer": x, "score": v, "reason": f"output SQNR {fmt_db(v)} dB with {how} "
                    f"(first {len(some)} calibration samples)"})  # fmt: skip
    out.sort(key=lambda r: (-sort_key(r["score"]), layers.index(r["layer"])))
    return out


def int16_first_search(eg: EscalationGraph, fb: AutoFallback, held=()) -> FallbackDecision:
    """Rank and walk (module docstring) on ``eg`` (simulated with layer switches)."""
    t0 = time.perf_counter()
    sim = eg.sim
    layers = [m.layer for m in sim.matches if m.layer in eg.switchable]
    feeders = layer_feeders(sim)
    trials = _Trials(eg, fb, layer_int16_slots(eg), held)
    value = trials([], [], "base")
    ranking = _rank(eg, fb, trials, layers, feeders) if not trials.within(value) else []
    fp32, i16 = [], []
    for r in ranking[: WALK * max(fb.max_fp32_layers, 1)]:
        if trials.within(value):
            break
        x = r["layer"]
        if x in fp32 or x in i16:
            continue
        group = [y for y in (x, *feeders.get(x, [])) if y not in fp32]
        steps = [("int16", fp32, [*i16, x])] if x in trials.slots else []
        steps.append(("fp32", [*fp32, *group], [y for y in i16 if y not in group]))
        for kind, f, s in steps:
            if len(f) + len(s) > fb.max_fp32_layers:
                continue
            v = trials(f, s, kind)
            if sort_key(v) <= sort_key(value):
                continue  # does not improve the calibration samples
            if trials.gain(f, s):
                fp32, i16, value = f, s, v
                break
    met = trials.within(value)
    if not met:
        warnings.warn(
            f"AutoFallback(int16_first): {trials.budget} not reached with up to "
            f"{fb.max_fp32_layers} layers above int8; using {len(fp32)} fp32 + {len(i16)} "
            f"int16 layers ({trials.name} {fmt_db(value)})",
            stacklevel=2,
        )
    n_rank = len(ranking) if fb.ranking == "revert" else 0
    return FallbackDecision(
        layers=fp32,
        precision="int16_first",
        met=met,
        metric_name=trials.name,
        metric=value,
        reference=trials.reference,
        budget=f"{trials.budget}; at most {fb.max_fp32_layers} layers above int8",
        ranking=ranking,
        trials=trials.log,
        seconds=time.perf_counter() - t0,
        analysis_seconds=eg.compile_s,
        evaluations=len(trials.log) + n_rank,
        int16_layers=i16,
    )


def int16_first(
    model, params, dataset, config: Config, qparams: QParams | None = None, target=None,
    fan_out=None,
) -> FallbackOutcome:  # fmt: skip
    """Run ``AutoFallback(precision="int16_first")`` end to end (module docstring), with the
    call shape of :func:`autoq.fallback.auto_fallback.auto_fallback`."""
    fb, target, base_cfg, calib, held = search_setup(
        config, "int16_first", dataset, target, fan_out
    )
    if qparams is None:
        qparams = calibrate(
            simulate(model, params, base_cfg), params, calib, base_cfg, target=target
        )
    sim = simulate(model, params, base_cfg, switches=True)
    eg = EscalationGraph(sim, qparams, calib, target)
    decision = int16_first_search(eg, fb, held)
    return apply_decision(eg, decision, model, params, base_cfg)


def apply_decision(eg: EscalationGraph, decision: FallbackDecision, model, params, config):
    """The :class:`FallbackOutcome` that realizes ``decision`` (found on ``eg``) for
    ``config`` (the fixed fallback rules): fp32 layers, int16 overrides, and the qparams
    the search measured (int16 ones from the observed ranges)."""
    final_cfg = decision.config(config)
    slots = layer_int16_slots(eg)
    chosen = {s: eg.qparams16[s] for x in decision.int16_layers for s in slots[x]}
    qp = eg.qparams
    # the tuned biases of the layers reading an int16 slot, at their new accumulator scale
    # (remap_qparams dequantizes them with the qparams it is given: the int16 ones)
    values = requantized_biases(eg.sim, qp, chosen)
    src = QParams({**qp.params, **chosen}, dict(qp.slots), qp.meta, values)
    final_qp = remap_qparams(eg.sim, src, simulate(model, params, final_cfg))
    final_qp.meta["fallback"] = decision.to_json()
    return FallbackOutcome(final_cfg, final_qp, decision, None, None)
