"""Automatic int16 escalation: the activation tensors the output is sensitive to go int16.

``Config(fallback=AutoFallback(precision="int16_tensors", max_int16_fraction=0.2))``: after
calibration, :func:`escalate` measures, for each candidate activation tensor (slot), how much
the model's metric drops when that tensor goes back to int8 while the other candidates are
int16 (candidates: the ``SHORTLIST`` x budget tensors whose own int8 SQNR is lowest:
:func:`shortlist`). With
the others int16 each tensor's own cost shows; ranked by "only this one int16" it hides under
the error of all the rest (MiniLM, 32 held-out sentences: cosine 0.985 that way vs 0.991
for this ranking, budget 22 tensors). It then adds the tensors in that order until the
metric meets the budget or ``max_int16_fraction`` of the activation tensors are int16; with
``AutoFallback.holdout`` the result is the prefix of that sequence with the best output
SQNR on the held-out samples (tensors that only help the calibration samples are dropped).
``AutoFallback(search="eliminate")`` instead runs a backward elimination from every
candidate int16 (:mod:`autoq.fallback.escalation_elimination`).
Every layer stays quantized (int8 weights, integer kernels); the chosen
tensors are written to ``Config.int16_tensors`` (slot ids), which :mod:`autoq.simulation`
gives an int16 spec, so realize/simulate agree bit for bit as for any int16 slot.

**One compile for the whole search.** :class:`EscalationGraph` rewrites the calibrated
simulated graph so that every candidate slot's quantize reads three more runtime inputs,
``<slot>.int16`` (a float32 switch), ``<slot>.scale16`` and ``<slot>.zero_point16``: with
the switch on, the slot's integers are the int16 ones re-expressed on the int8 grid,
``(q16 - z16) * s16 / s + z``, so every consumer (which dequantizes with ``s``, ``z``)
computes with the int16 value (up to float32 rounding). A lookup-table activation whose
input or output slot is switched computes its float activation and quantizes it, as the
realized graph does for a 16-bit slot. A per-channel residual-stream slot
(:mod:`autoq.rules.residual_channels`) is a candidate too: ``s``, ``z`` are then its per-channel
vectors on the last axis (the formula broadcasts), and once picked it is int16 per tensor.
Each trial is then one run over the first :data:`autoq.layer_rules.TRIAL_SAMPLES`
calibration samples (SQNR metric; a callable metric picks its own).

int16 qparams come from the tensor's full observed range on the calibration samples, times
:data:`INT16_HEADROOM` (:func:`int16_qparam`): the int8 calibrator's clipping is what int16
is there to avoid, and values beyond the calibration range are what clipped it on new data.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import tvm
from tvm import relax

from autoq import qnn
from autoq.calibration import calibrate, samples_for
from autoq.config import AutoFallback, Config, QuantSpec
from autoq.fallback.auto_fallback import FallbackDecision, FallbackOutcome, split_holdout
from autoq.fallback.escalation_elimination import eliminate, prune_on_held
from autoq.ir.run import calibration_pipeline
from autoq.ir.target import default_target
from autoq.ir.toolkit import (
    as_list,
    bindings,
    compile_vm,
    const,
    is_call,
    make_function,
    output_fields,
)
from autoq.layer_rules import TRIAL_SAMPLES
from autoq.metrics import ErrorStats, fake_quant, sqnr_db
from autoq.primitives import quantize_bias
from autoq.qparams import QParam, QParams
from autoq.simulation import SimResult, simulate

__all__ = [
    "EscalationGraph",
    "escalate",
    "escalate_search",
    "int16_qparam",
    "requantized_biases",
    "search_setup",
    "shortlist",
    "trial_set",
]

WIDE = {"int8": "int16", "uint8": "int16"}


#: int16 ranges are the observed range times this: 16 bits leave room for values beyond
#: the calibration samples (MiniLM, every activation int16, 32 held-out sentences: cosine
#: 0.9955 / 0.9986 / 0.9996 with headroom 1 / 2 / 4), at 2 bits of resolution
INT16_HEADROOM = 4.0


def int16_qparam(lo, hi, spec: QuantSpec) -> QParam:
    """int16 qparams for a tensor observed in ``[lo, hi]`` (``spec``: its spec): the range
    widened by :data:`INT16_HEADROOM` around 0.

    >>> qp = int16_qparam(-1.0, 3.0, QuantSpec())
    >>> qp.dtype, float(qp.rmin), float(qp.rmax)
    ('int16', -4.0, 12.0)
    """
    s = spec.as_int16()
    lo = np.minimum(lo, 0.0).astype(np.float32) * np.float32(INT16_HEADROOM)
    hi = np.maximum(hi, 0.0).astype(np.float32) * np.float32(INT16_HEADROOM)
    return QParam.from_range(lo, hi, s.dtype, s.symmetric, s.narrow_range, s.reduce_range)


def _f32(x) -> relax.Expr:
    return relax.op.astype(x, "float32")


class EscalationGraph:
    """The calibrated simulated graph with a runtime int16 switch per candidate slot
    (module docstring); :meth:`run` runs it with any set of slots switched to int16."""

    def __init__(self, sim: SimResult, qparams: QParams, samples, target):
        t0 = time.perf_counter()
        self.sim, self.qparams = sim, qparams
        g = sim.graph
        self.samples = samples_for(samples, g.inputs)
        #: 8-bit activation slots with a quantize of their own, per tensor or per channel
        #: (lookup and depthwise inputs along their axis, the residual stream on its last axis:
        #: :mod:`autoq.rules.lut_channels`, :mod:`autoq.rules.depthwise_channels`,
        #: :mod:`autoq.rules.residual_channels`; int16 makes it per tensor)
        self.candidates = [
            sid
            for sid in sim.activation_slots()
            if sid in sim.sq_vars
            and qparams[sid].dtype in WIDE
            and (np.ndim(qparams[sid].scale) == 0 or sim.plan.slots[sid].axis is not None)
        ]
        self.n_activation_slots = len(sim.activation_slots())
        #: activation slots int16 before the search (``Config.int16_tensors``, overrides)
        self.already_int16 = [s for s in sim.activation_slots() if qparams[s].dtype not in WIDE]
        self._vars = {
            sid: (
                relax.Var(f"{sid}.int16", relax.TensorType([], "float32")),
                relax.Var(f"{sid}.scale16", relax.TensorType([], "float32")),
                relax.Var(f"{sid}.zero_point16", relax.TensorType([], "int32")),
            )
            for sid in self.candidates
        }
        func = sim.mod["main"]
        pairs, pre = self._rewrite(func)
        params = list(func.params) + [v for t in self._vars.values() for v in t]
        self._params = params
        #: layers with a ``<layer>.enable`` switch (a graph simulated with switches)
        self.switchable = [p.name[: -len(".enable")] for p in params if p.name.endswith(".enable")]
        self.n_out = len(output_fields(func.body.body))
        functions = {
            "trial": make_function("trial", params, pairs, output_fields(func.body.body)),
            "ranges": make_function("ranges", params, pairs, pre),
            "fp32": make_function(
                "fp32", list(g.inputs) + list(g.weight_params), g.bindings,
                output_fields(g.output),
            ),
        }  # fmt: skip
        consts = {p.name: np.ascontiguousarray(g.params[p.name]) for p in g.weight_params}
        consts.update(sim.input_values(qparams))
        self._consts = {k: tvm.runtime.tensor(v) for k, v in consts.items()}
        self._on = tvm.runtime.tensor(np.float32(1.0))
        self._off = tvm.runtime.tensor(np.float32(0.0))
        self.vm = compile_vm(functions, target, sim.mod, pipeline=calibration_pipeline(target))
        self.compile_s = time.perf_counter() - t0
        self.qparams16 = self._int16_qparams()

    def _rewrite(self, func) -> tuple[list, list]:
        """The bindings of ``func`` with the candidates' quantizes switchable, and the float
        input of each candidate's quantize (for its observed range)."""
        sim = self.sim
        sq_of = {sim.sq_vars[sid]: sid for sid in self.candidates}
        # a LUT layer's table input -> (its input slot, its output slot)
        lut_of = {sim.table_vars[layer]: t[:2] for layer, t in sim.plan.tables.items()}
        out, pre = [], []
        #: the candidates in the order their quantize is bound (topological order)
        self.topological = []
        for var, value in bindings(func):
            sid = sq_of.get(var)
            if sid is not None:
                self.topological.append(sid)
                sel, s16, z16 = self._vars[sid]
                data, s, z = value.args[:3]
                # a switched graph's layer switch (autoq.fallback.analysis): off -> unrounded, both ways
                enable = value.args[3] if len(value.args) > 3 else None
                q8 = relax.Var(f"{sid}.q8")
                q16 = relax.Var(f"{sid}.q16")
                out.append((q8, value))
                q16_value = qnn.simulated_quantize(data, s16, z16, dtype="int16", enable=enable)
                out.append((q16, q16_value))
                s, z = self._along_axis(sid, s), self._along_axis(sid, z)
                on8 = relax.op.add(
                    relax.op.multiply(relax.op.subtract(q16, _f32(z16)), relax.op.divide(s16, s)),
                    _f32(z),
                )
                on = relax.op.greater(sel, const(0.0, "float32"))
                out.append((var, relax.op.where(on, on8, q8)))
                pre.append(data)
                continue
            if is_call(value, "relax.reshape") and value.args[0] in lut_of:
                lut_of[var] = lut_of[value.args[0]]  # a per-channel table, flattened
            key = lut_of.get(value.args[0]) if is_call(value, "relax.take") else None
            if key is not None:
                sels = [self._vars[s][0] for s in key if s in self._vars]
                observed = sim.sq_vars[key[1]]
                if sels:
                    on = sels[0] if len(sels) == 1 else relax.op.maximum(*sels)
                    on = relax.op.greater(on, const(0.0, "float32"))
                    table = relax.Var(f"{key[1]}.table_q")
                    out.append((table, value))
                    out.append((var, relax.op.where(on, observed, table)))
                    continue
            out.append((var, value))
        return out, pre

    def _along_axis(self, sid: str, v: relax.Expr) -> relax.Expr:
        """A per-channel slot's [C] scale / zero point shaped to broadcast along its axis
        (a per-tensor one as it is)."""
        info = self.sim.plan.slots[sid]
        if info.axis is None:
            return v
        shape = [1] * len(info.shape)
        shape[info.axis] = int(info.shape[info.axis])
        return relax.op.reshape(v, shape)

    def _args(self, sample: dict, selected: set, qp16: dict, disabled=frozenset()) -> list:
        inputs = {v.name for v in self.sim.graph.inputs}
        args = []
        for p in self._params:
            name = p.name
            if name in inputs:
                args.append(tvm.runtime.tensor(sample[name]))
            elif name in self._consts:
                args.append(self._consts[name])
            else:
                sid, _, kind = name.rpartition(".")
                if kind == "enable":  # a layer switch (``sim`` simulated with switches)
                    args.append(self._off if sid in disabled else self._on)
                elif kind == "int16":
                    args.append(self._on if sid in selected else self._off)
                elif kind == "scale16":
                    args.append(tvm.runtime.tensor(np.asarray(qp16[sid].scale, np.float32)))
                else:
                    args.append(tvm.runtime.tensor(np.asarray(qp16[sid].zero_point, np.int32)))
        return args

    def _int16_qparams(self) -> dict[str, QParam]:
        """int16 qparams of every candidate from its observed range (all slots int8), and
        each candidate's own int8 SQNR on those values (``self.local_sqnr``)."""
        lo = {s: math.inf for s in self.candidates}
        hi = {s: -math.inf for s in self.candidates}
        err = {s: ErrorStats() for s in self.candidates}
        dummy = {s: QParam(1.0, 0, "int16") for s in self.candidates}
        f = self.vm["ranges"]
        for sample in self.samples:
            vals = as_list(f(*self._args(sample, set(), dummy)))
            for sid, v in zip(self.candidates, vals, strict=True):
                a = v.numpy()
                if a.size == 0:
                    continue
                lo[sid] = min(lo[sid], float(a.min()))
                hi[sid] = max(hi[sid], float(a.max()))
                err[sid].add(a, fake_quant(a, self.qparams[sid])[0])
        #: slot -> SQNR (dB) of its int8 quantization alone, on the calibration samples
        self.local_sqnr = {sid: e.sqnr for sid, e in err.items()}
        specs = self.sim.plan.specs
        return {s: int16_qparam(lo[s], hi[s], specs[s]) for s in self.candidates}

    def run(self, selected: Iterable[str] = (), samples=None, disabled: Iterable[str] = ()) -> list:
        """Model outputs (one per sample) with the ``selected`` slots int16 and, when ``sim``
        was simulated with switches (as :class:`autoq.fallback.analysis.Analysis` does), the
        ``disabled`` layers in fp32."""
        selected, disabled = set(selected), frozenset(disabled)
        unknown = disabled - set(self.switchable)
        if unknown:
            raise ValueError(f"no switch for layers {sorted(unknown)} in this graph")
        unknown = selected - set(self.candidates)
        if unknown:
            raise ValueError(f"not escalable slots {sorted(unknown)}")
        data = self.samples if samples is None else samples_for(samples, self.sim.graph.inputs)
        f = self.vm["trial"]
        outs = []
        for s in data:
            args = self._args(s, selected, self.qparams16, disabled)
            vals = [v.numpy() for v in as_list(f(*args))]
            outs.append(vals[0] if self.n_out == 1 else vals)
        return outs

    def run_fp32(self, samples=None) -> list:
        """Model outputs of the fp32 graph, one per sample."""
        g = self.sim.graph
        data = self.samples if samples is None else samples_for(samples, g.inputs)
        f, outs = self.vm["fp32"], []
        for s in data:
            args = [tvm.runtime.tensor(s[v.name]) for v in g.inputs]
            args += [self._consts[p.name] for p in g.weight_params]
            vals = [v.numpy() for v in as_list(f(*args))]
            outs.append(vals[0] if self.n_out == 1 else vals)
        return outs

    def runner(self, selected: Iterable[str] = (), disabled: Iterable[str] = ()) -> Callable:
        selected, disabled = tuple(selected), tuple(disabled)
        return lambda samples: self.run(selected, samples, disabled)

    def qparams_with(self, selected: Sequence[str], dst: SimResult) -> QParams:
        """The calibrated qparams with ``selected`` slots int16, for ``dst`` (the graph
        simulated with ``Config.int16_tensors = selected``: same slot ids)."""
        out = {sid: self.qparams[sid] for sid in dst.slots}
        for sid in selected:
            out[sid] = self.qparams16[sid]
        meta = dict(self.qparams.meta)
        meta["specs"] = {s: sp.to_json() for s, sp in dst.plan.specs.items()}
        values = requantized_biases(self.sim, self.qparams, {s: out[s] for s in selected})
        return QParams(out, dict(dst.slots), meta, values)


def requantized_biases(sim: SimResult, qparams: QParams, wider: dict[str, QParam]) -> dict:
    """``qparams.values`` with each calibrated int32 bias (GPTQ / bias correction) of a layer
    whose input slot gets the ``wider`` (int16) qparams re-quantized at the new accumulator
    scale: the same float bias (dequantized with the int8 input scale it was quantized for)."""
    values = dict(qparams.values)
    for layer, (_arr, x_sid, w_sid) in sim.plan.biases.items():
        key = f"{layer}.bias"
        if key in values and x_sid in wider:
            b = sim.value_input(key, qparams)
            values[key] = quantize_bias(b, wider[x_sid].scale, qparams[w_sid].scale).values
    return values


def trial_set(eg: EscalationGraph) -> list:
    """The calibration samples the SQNR metric's trials run on: the first
    :data:`autoq.layer_rules.TRIAL_SAMPLES`."""
    return list(eg.samples)[:TRIAL_SAMPLES]


#: tensors measured one by one: the SHORTLIST x budget with the lowest own int8 SQNR
SHORTLIST = 3


def shortlist(eg: EscalationGraph, limit: int) -> list:
    """The tensors the search measures: the ``SHORTLIST * limit`` with the lowest own int8
    SQNR."""
    return sorted(eg.candidates, key=lambda sid: eg.local_sqnr[sid])[: SHORTLIST * limit]


def escalate_search(
    eg: EscalationGraph, fb: AutoFallback, reference_run: Callable, held=()
) -> dict:
    """Greedy search (module docstring). ``reference_run(samples) -> outputs``: the fp32
    model. Returns ``{"tensors", "metric", "met", "budget", "ranking", "trials", ...}``."""
    t0 = time.perf_counter()
    if fb.metric == "sqnr":
        some = trial_set(eg)
        ref = reference_run(some)

        def score(sel):
            return sqnr_db(ref, eg.run(sel, some))

        reference, within = math.inf, (lambda v: v >= fb.min_sqnr)
        name, budget = "output SQNR (dB)", f"SQNR >= {fb.min_sqnr:g} dB"
    else:
        reference = float(fb.metric(reference_run))

        def score(sel):
            return float(fb.metric(eg.runner(sel)))

        def within(v):
            return reference - v <= fb.max_drop

        name = getattr(fb.metric, "__name__", "metric")
        budget = f"drop <= {fb.max_drop:g} from fp32 {reference:.6g}"
    total = math.floor(fb.max_int16_fraction * eg.n_activation_slots + 1e-9)
    limit = max(0, total - len(eg.already_int16))
    trials: list[dict] = []

    def trial(sel, kind, **extra):
        v = score(sel)
        trials.append({"k": len(sel), "layers": list(sel), "metric": v, "kind": kind, **extra})
        return v

    base = trial([], "base")
    if fb.search == "eliminate":
        found = _eliminated(eg, trial, within, base, limit, (reference_run, held), name)
    else:
        found = _greedy(eg, trial, within, base, limit, (reference_run, held), name)
    chosen, value, ranking = found
    return {
        "tensors": chosen,
        "metric": value,
        "base": base,
        "met": within(value),
        "metric_name": name,
        "reference": reference,
        "budget": f"{budget}; at most {total} of {eg.n_activation_slots} activation tensors "
        f"int16 ({len(eg.already_int16)} already)",
        "ranking": ranking,
        "trials": trials,
        "seconds": time.perf_counter() - t0,
    }


def _greedy(eg: EscalationGraph, trial, within, base, limit, fp32_held, name):
    """The greedy search (module docstring): (tensors, metric, ranking)."""
    ranking, top = [], base
    if not within(base) and limit > 0:
        short = shortlist(eg, limit)
        top = trial(short, "all")
        for sid in short:  # what each costs back in int8 while the others are int16
            ranking.append({"layer": sid, "score": trial([x for x in short if x != sid], "revert")})
        ranking.sort(key=lambda r: r["score"])
    gain = _held_gain(eg, *fp32_held)
    chosen, value, final = [], base, ([], base)
    for r in ranking:  # add in ranked order; keep the prefix the held-out samples prefer
        if within(value) or len(chosen) >= limit or not r["score"] < top:
            break
        chosen = [*chosen, r["layer"]]
        kept = gain(chosen)
        value = trial(chosen, "greedy", kept=kept)
        if kept:
            final = (list(chosen), value)
    for r in ranking:
        r["reason"] = (
            f"{name} {r['score']:.4g} with this tensor int8 and the other shortlisted ones "
            f"int16 (all int16: {top:.4g}, all int8: {base:.4g}); its own int8 SQNR "
            f"{eg.local_sqnr[r['layer']]:.1f} dB"
        )
    return *final, ranking


def _eliminated(eg: EscalationGraph, trial, within, base, limit, fp32_held, name):
    """Backward elimination over every candidate, then the held-out pruning
    (:mod:`autoq.fallback.escalation_elimination`): (tensors, metric, ranking)."""
    if within(base) or limit <= 0:
        return [], base, []
    kept, value, cost, _rounds = eliminate(
        eg.topological, limit, lambda sel: trial(sel, "eliminate"), within
    )
    chosen, _held = prune_on_held(kept, _held_score(eg, *fp32_held))
    ranking = sorted(
        ({"layer": sid, "score": value - cost[sid]} for sid in kept), key=lambda r: r["score"]
    )
    for r in ranking:
        r["reason"] = (
            f"{name} {r['score']:.4g} with this tensor int8 and the rest of the eliminated set "
            f"int16 (that set: {value:.4g}, all int8: {base:.4g}); "
            + ("kept" if r["layer"] in chosen else "dropped by the held-out check")
        )
    if chosen != kept:
        value = trial(chosen, "held-out pruned") if chosen else base
    return chosen, value, ranking


def _held_score(eg: EscalationGraph, reference_run, held):
    """``score(selected)``: the output SQNR on the held-out samples (None without them)."""
    if not held:
        return None
    ref = reference_run(held)
    return lambda sel: sqnr_db(ref, eg.run(sel, held))


def _held_gain(eg: EscalationGraph, reference_run, held):
    """``gain(selected) -> bool``: whether ``selected`` raise the output SQNR on the held-out
    samples above the best so far (always True without held-out samples)."""
    if not held:
        return lambda sel: True
    ref = reference_run(held)
    best = [sqnr_db(ref, eg.run([], held))]

    def gain(sel):
        v = sqnr_db(ref, eg.run(sel, held))
        if v > best[0]:
            best[0] = v
            return True
        return False

    return gain


def search_setup(config: Config, precision: str, dataset, target, fan_out):
    """What an in-process ``AutoFallback(precision=...)`` search starts from: the options
    (checked), the target, the config with only the fixed fallback rules, and the
    calibration / held-out split of ``dataset``. A cluster (``fan_out``) is refused."""
    fb = config.fallback
    if not isinstance(fb, AutoFallback) or fb.precision != precision:
        raise TypeError(f"config.fallback must be an AutoFallback(precision={precision!r})")
    if fan_out is not None:
        raise ValueError(
            f"AutoFallback(precision={precision!r}) searches in this process: calibrate "
            "without a cluster, or use precision='fp32'/'int16'"
        )
    calib, held = split_holdout(dataset, fb.holdout)
    return fb, target or default_target(), config.replace(fallback=fb.fixed()), calib, held


def escalate(
    model, params, dataset, config: Config, qparams: QParams | None = None, target=None,
    fan_out=None,
) -> FallbackOutcome:  # fmt: skip
    """Run ``AutoFallback(precision="int16_tensors")`` end to end (module docstring):
    calibrate (unless ``qparams`` are given, calibrated on the dataset minus the held-out
    samples), compile the :class:`EscalationGraph`, search, and return the config with
    ``int16_tensors`` and its qparams (same call shape as :func:`autoq.fallback.auto_fallback.auto_fallback`)."""
    fb, target, base_cfg, calib, held = search_setup(
        config, "int16_tensors", dataset, target, fan_out
    )
    sim = simulate(model, params, base_cfg)
    if qparams is None:
        qparams = calibrate(sim, params, calib, base_cfg, target=target)
    eg = EscalationGraph(sim, qparams, calib, target)
    found = escalate_search(eg, fb, eg.run_fp32, held)
    decision = FallbackDecision(
        layers=found["tensors"],
        precision="int16_tensors",
        met=found["met"],
        metric_name=found["metric_name"],
        metric=found["metric"],
        reference=found["reference"],
        budget=found["budget"],
        ranking=found["ranking"],
        trials=found["trials"],
        seconds=found["seconds"],
        analysis_seconds=eg.compile_s,
        evaluations=len(found["trials"]),
    )
    final_cfg = decision.config(base_cfg)
    final_sim = simulate(model, params, final_cfg)
    final_qp = eg.qparams_with(found["tensors"], final_sim)
    final_qp.meta["fallback"] = decision.to_json()
    return FallbackOutcome(final_cfg, final_qp, decision, None, None)
