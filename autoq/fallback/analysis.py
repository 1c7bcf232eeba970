"""Which layer hurts? The per-layer error analysis engine.

:func:`analyze` returns a :class:`autoq.fallback.report.Report`: for every quantized tensor (slot) and every layer,
the SQNR (dB) and cosine of the quantized value against the fp32 value, measured two ways,

* **alone**: only this slot / layer is quantized, its inputs are the fp32 values;
* **upstream**: everything up to and including it is quantized (the deployed graph);

plus each slot's chosen range, scale, zero point and fraction of clipped values, and each
accumulating layer's headroom: the largest |int32 accumulator| seen and how many values
would overflow a narrower accumulator (``accumulator="int16"`` by default).

**How it is computed (cost: about three passes of the graph over the data, one compile).**
One module is compiled with

* ``fp32``: the float graph returning every slot tensor and layer output;
* ``sim``: the simulated graph built with per-layer switches (``simulate(...,
  switches=True)``: an ``enable`` input of ``qnn.simulated_quantize`` per layer, see
  :mod:`autoq.simulation`), returning each slot's float input to its quantize, each layer's
  output and accumulator. With every switch on it computes exactly the calibrated
  simulated graph (which the realized graph equals bit for bit), so **one** run gives every
  "upstream" number;
* ``layer_<i>``: each layer's own part of the simulated graph (a slice from its output back
  to the activations it reads), run on the fp32 values of those activations: every "alone"
  number without re-running the graph per layer. A slot's "alone" numbers are the
  quantize/dequantize of its fp32 tensor, computed in numpy.

Statistics stream over the samples (sums of squares, products, counts); nothing is kept
per sample. SQNR = ``10 log10(sum(ref^2) / sum((ref - q)^2))`` over the whole dataset,
cosine likewise over all elements.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from autoq import primitives as P
from autoq.calibration import calibrate, samples_for
from autoq.config import AutoFallback, Config
from autoq.config.progress import bar as progress_bar
from autoq.dataset import is_shard_source
from autoq.fallback.report import LayerStats, Report, SlotStats
from autoq.ir.target import default_target
from autoq.ir.toolkit import (
    as_list,
    bindings,
    compile_vm,
    free_vars,
    is_call,
    make_function,
    output_fields,
    slice_bindings,
)
from autoq.metrics import ErrorStats, fake_quant
from autoq.qparams import QParams, f32_list
from autoq.recipes import resolve
from autoq.rules.exits import int32_carriers
from autoq.simulation import SimResult, simulate

__all__ = ["Analysis", "analyze", "layer_feeders"]


def _as_outputs(vals: list, n: int):
    out = [v.numpy() for v in vals[:n]]
    return out[0] if n == 1 else out


@dataclass
class _LayerPlan:
    name: str
    pattern: str
    index: int
    root: relax.Var  # fp32 graph Var
    sim_root: relax.Var
    acc: relax.Var | None
    inputs: list  # segment function inputs (sim Vars / params)
    feeds: list  # for each input: ("fp32", orig var) or ("param", param var)
    outputs: list


def layer_feeders(sim: SimResult) -> dict[str, list[str]]:
    """Layer -> the layers whose int32 results it reads as activations."""
    carriers = int32_carriers(sim.graph, sim.matches, sim.plan.dynamic)
    out: dict[str, list[str]] = {}
    for m in sim.matches:
        covered = set(m.covered)
        for v in m.nodes.values():
            p = carriers.get(v) if isinstance(v, relax.Var) and v not in covered else None
            if p is not None and p.layer != m.layer and p.layer not in out.get(m.layer, []):
                out.setdefault(m.layer, []).append(p.layer)
    return out


def _layer_plans(sim: SimResult) -> list[_LayerPlan]:
    """Per layer: its root and accumulator in the simulated graph, and the inputs of its
    own slice of that graph (fp32 tensors of the float graph, or parameters)."""
    g = sim.graph
    value_of = dict(bindings(sim.mod["main"]))
    stop = {
        sv: v
        for v, sv in sim.values.items()
        if isinstance(sv, relax.Var) and g.is_data_dependent(v)
    }
    stop.update({v: v for v in g.inputs})
    plans: list[_LayerPlan] = []
    for i, m in enumerate(sim.matches):
        sroot = sim.values[m.root]
        acc = None
        rv = value_of.get(sroot)
        if is_call(rv, "qnn.simulated_dequantize") and isinstance(rv.args[0], relax.Var):
            a = rv.args[0]
            if a in value_of and not is_call(value_of[a], "qnn.simulated_quantize"):
                acc = a
        inputs, seen = [], set()
        stack = [sroot]
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if not v.same_as(sroot) and v in stop:
                inputs.append(v)
            elif v in value_of:
                stack.extend(free_vars(value_of[v]))
            else:
                inputs.append(v)  # a parameter: weight, qparam, switch
        inputs.sort(key=lambda v: v.name)
        feeds = [("fp32", stop[v]) if v in stop else ("param", v) for v in inputs]
        outs = [sroot] + ([acc] if acc is not None else [])
        plans.append(
            _LayerPlan(m.layer, m.pattern.name, i, m.root, sroot, acc, inputs, feeds, outs)
        )
        if not any(f[0] == "param" and f[1].name.endswith(".enable") for f in feeds):
            raise RuntimeError(f"internal error: layer {m.layer} has no switch")
    return plans


class Analysis:
    """The compiled analysis of one model + qparams (see the module docstring): build it
    once, then :meth:`report` and any number of :meth:`run` trials."""

    def __init__(
        self,
        mod,
        params: dict | None,
        dataset,
        qparams: QParams | Callable[[SimResult], QParams],
        config: Config | None = None,
        target=None,
        accumulator: str = "int16",
    ):
        """``mod``: the fp32 IRModule or its :class:`autoq.ir.matching.Matched`; ``qparams``:
        calibrated for ``config``, or a function of this analysis' simulated graph that
        returns them (qparams of another config, re-keyed)."""
        t0 = time.perf_counter()
        self.config = config or Config()
        self.target = target or default_target()
        P.qrange(accumulator)
        self.accumulator = accumulator
        sim = self.sim = simulate(mod, params, self._sim_config(), switches=True)
        self.config = resolve(self.config, sim.graph)[0]
        qparams = self.qparams = qparams(sim) if callable(qparams) else qparams
        missing = [s for s in sim.slots if s not in qparams]
        if missing:
            raise KeyError(
                f"the qparams lack slots {missing[:5]} of this model/config: calibrate with the "
                "same config"
            )
        g = sim.graph
        #: the validated samples; None when ``dataset`` is a shard source that the workers
        #: of a distributed run read (``autoq.distributed.AnalysisFanOut``)
        self.source = dataset if is_shard_source(dataset) else None
        self.samples = None if self.source is not None else samples_for(dataset, g.inputs)
        self.layers = [m.layer for m in sim.matches]
        self._weights = {
            p.name: tvm.runtime.tensor(np.ascontiguousarray(g.params[p.name]))
            for p in g.weight_params
        }
        self._qvals = {k: tvm.runtime.tensor(v) for k, v in sim.input_values(qparams).items()}
        self._on = tvm.runtime.tensor(np.float32(1.0))
        self._off = tvm.runtime.tensor(np.float32(0.0))
        self.act_slots = sim.activation_slots()
        self._plans = _layer_plans(sim)
        #: layer -> the layers whose int32 result it reads (autoq.rules.exits)
        self.feeders = layer_feeders(sim)
        functions = self._functions()
        t1 = time.perf_counter()
        self.vm = compile_vm(functions, self.target, sim.mod)
        self.timings = {"build_s": t1 - t0, "compile_s": time.perf_counter() - t1}
        self._fp32_outputs: list | None = None

    def _functions(self) -> dict[str, relax.Function]:
        """``fp32`` (model outputs + every tensor compared or fed), ``sim`` (model outputs,
        slot pre-quantize inputs, layer outputs and accumulators), ``layer_<i>``."""
        sim, g = self.sim, self.sim.graph
        func = sim.mod["main"]
        pairs = bindings(func)
        value_of = dict(pairs)
        out_fields = output_fields(g.output)
        self.n_out = len(out_fields)
        fp_vars: list = [sim.plan.tensors[sid] for sid in self.act_slots]
        for p in self._plans:
            fp_vars.append(p.root)
            fp_vars.extend(f[1] for f in p.feeds if f[0] == "fp32")
        self._fp_vars = list(dict.fromkeys(fp_vars))  # Vars hash and compare by identity
        fp_params = list(g.inputs) + list(g.weight_params)
        functions = {
            "fp32": make_function("fp32", fp_params, g.bindings, out_fields + self._fp_vars)
        }
        self._pre = [value_of[sim.sq_vars[sid]].args[0] for sid in self.act_slots]
        sim_outs = (
            output_fields(func.body.body)
            + self._pre
            + [p.sim_root for p in self._plans]
            + [p.acc for p in self._plans if p.acc is not None]
        )
        self._sim_params = list(func.params)
        functions["sim"] = make_function("sim", self._sim_params, pairs, sim_outs)
        for p in self._plans:
            functions[f"layer_{p.index}"] = make_function(
                f"layer_{p.index}", p.inputs, slice_bindings(pairs, p.outputs, p.inputs), p.outputs
            )
        return functions

    # ---- helpers
    def _sim_config(self) -> Config:
        fb = self.config.fallback
        if isinstance(fb, AutoFallback):
            return self.config.replace(fallback=fb.fixed())
        return self.config

    def _param_value(self, v, enable: dict | None = None):
        name = v.name
        if name in self._weights:
            return self._weights[name]
        if name in self._qvals:
            return self._qvals[name]
        if name.endswith(".enable"):
            layer = name[: -len(".enable")]
            return self._off if enable is not None and layer in enable else self._on
        raise KeyError(f"internal error: no value for parameter {name!r}")

    def _sim_args(self, sample: dict, disabled=()) -> list:
        g = self.sim.graph
        dis = set(disabled)
        inputs = {v.name for v in g.inputs}
        args = []
        for p in self._sim_params:
            if p.name in inputs:
                args.append(tvm.runtime.tensor(sample[p.name]))
            else:
                args.append(self._param_value(p, dis))
        return args

    def _fp32_args(self, sample: dict) -> list:
        g = self.sim.graph
        return [tvm.runtime.tensor(sample[v.name]) for v in g.inputs] + [
            self._weights[p.name] for p in g.weight_params
        ]

    def _own(self):
        """The analysis dataset (not when the workers read it)."""
        if self.samples is None:
            raise ValueError(
                f"this analysis' samples ({self.source.describe()}) are read by the workers "
                "of a distributed run, not by this process: run it with "
                "autoq.distributed.report_distributed / AnalysisFanOut, or give the samples"
            )
        return self.samples

    # ---- public
    def run(self, disabled: Iterable[str] = (), samples=None) -> list:
        """Model outputs of the calibrated simulated graph with the ``disabled`` layers in
        fp32, one per sample (an array, or a list for several outputs); ``samples``
        defaults to the analysis dataset."""
        disabled = set(disabled)
        unknown = disabled - set(self.layers)
        if unknown:
            raise ValueError(f"unknown layers {sorted(unknown)}")
        data = self._own() if samples is None else samples_for(samples, self.sim.graph.inputs)
        f = self.vm["sim"]
        return [_as_outputs(as_list(f(*self._sim_args(s, disabled))), self.n_out) for s in data]

    def run_fp32(self, samples=None) -> list:
        """Model outputs of the fp32 graph (cached for the analysis dataset)."""
        if samples is None and self._fp32_outputs is not None:
            return self._fp32_outputs
        data = self._own() if samples is None else samples_for(samples, self.sim.graph.inputs)
        f = self.vm["fp32"]
        outs = [_as_outputs(as_list(f(*self._fp32_args(s))), self.n_out) for s in data]
        if samples is None:
            self._fp32_outputs = outs
        return outs

    def runner(self, disabled: Iterable[str] = ()) -> Callable:
        """``run(samples) -> outputs`` for a metric callable (``disabled`` layers fp32)."""
        disabled = tuple(disabled)
        return lambda samples: self.run(disabled, samples)

    def report(self, progress: bool = False) -> Report:
        """Run the analysis over the dataset (see the module docstring); ``progress``: a
        progress bar over the samples (standard error)."""
        t0 = time.perf_counter()
        tally = self._tally()
        fp32_outs = []
        own = self._own()
        total = len(own) if hasattr(own, "__len__") else None
        bar = progress_bar(own, total=total, desc="report", unit="sample", show=progress)
        for sample in bar:
            fp32_outs.append(self._report_sample(sample, tally))
        self._fp32_outputs = fp32_outs
        return self._finish(tally, len(fp32_outs), t0)

    def _tally(self, make=None) -> _Tally:
        return _Tally(self.act_slots, self._plans, P.qrange(self.accumulator), make)

    def _finish(self, tally: _Tally, samples: int, t0: float) -> Report:
        slots = [self._slot_stats(sid, info, tally) for sid, info in self.sim.slots.items()]
        layers = [tally.layer_stats(p, self.sim.layer_slots.get(p.name, [])) for p in self._plans]
        self.timings["report_s"] = time.perf_counter() - t0
        return Report(
            layers=layers,
            slots=slots,
            output_sqnr=tally.output.sqnr,
            output_cos=tally.output.cos,
            accumulator=self.accumulator,
            samples=samples,
            meta={"timings": dict(self.timings)},
        )

    def shard_sums(self) -> dict:
        """The worker half of a distributed :meth:`report` over this analysis' samples, as
        plain data: per sample, the sums (:meth:`ErrorStats.sums`) each statistic received,
        in order, and the exact counters (clipped values, accumulator maxima, overflows)."""
        log: list = []
        tally = self._tally(lambda key: _LoggedStats(key, log))
        per_sample, fp32_outs = [], []
        for sample in self._own():
            start = len(log)
            fp32_outs.append(self._report_sample(sample, tally))
            per_sample.append(log[start:])
        self._fp32_outputs = fp32_outs
        return {"sums": per_sample, "counts": tally.counts()}

    def report_from_shards(self, shards: list[dict], order: list[tuple[int, int]]) -> Report:
        """The report from the :meth:`shard_sums` of several shards: ``order`` lists
        ``(shard, index in shard)`` of every sample in dataset order. The sums are added in
        that order, so the report equals :meth:`report` over the whole dataset (the same
        float additions)."""
        t0 = time.perf_counter()
        tally = self._tally()
        for sh, i in order:
            for key, sums in shards[sh]["sums"][i]:
                tally.stats(key).add_sums(*sums)
        for sh in shards:
            tally.merge_counts(sh["counts"])
        return self._finish(tally, len(order), t0)

    def _report_sample(self, sample, tally: _Tally):
        """One sample's fp32 and simulated runs, added to ``tally``; its fp32 outputs."""
        qp, nfp, n_out = self.qparams, len(self._fp_vars), self.n_out
        fo = as_list(self.vm["fp32"](*self._fp32_args(sample)))
        fp_out = [o.numpy() for o in fo[:n_out]]
        fpv = dict(zip(self._fp_vars, fo[n_out : n_out + nfp], strict=True))
        so = as_list(self.vm["sim"](*self._sim_args(sample)))
        for a, b in zip(fp_out, so[:n_out], strict=True):
            tally.output.add(a, b.numpy())
        k = n_out + len(self.act_slots)
        for sid, pv in zip(self.act_slots, so[n_out:k], strict=True):
            tally.slot(sid, fpv[self.sim.plan.tensors[sid]].numpy(), pv.numpy(), qp[sid])
        accs = iter(so[k + len(self._plans) :])
        for p, rv in zip(self._plans, so[k : k + len(self._plans)], strict=True):
            args = [fpv[f[1]] if f[0] == "fp32" else self._param_value(f[1]) for f in p.feeds]
            alone = as_list(self.vm[f"layer_{p.index}"](*args))[0].numpy()
            acc = next(accs).numpy() if p.acc is not None else None
            tally.layer(p.name, fpv[p.root].numpy(), rv.numpy(), alone, acc)
        return fp_out[0] if n_out == 1 else fp_out

    def _slot_stats(self, sid: str, info, tally: _Tally) -> SlotStats:
        q = self.qparams[sid]
        if info.kind == "weight":
            arr, _axis = self.sim.plan.weights[sid]
            dq, clipped = fake_quant(arr, q)
            e = ErrorStats()
            e.add(arr, dq)
            alone = up = e
            clip, elems = clipped / arr.size, arr.size
        else:
            alone, up = tally.slot_alone[sid], tally.slot_up[sid]
            elems = tally.slot_n[sid]
            clip = tally.slot_clip[sid] / max(elems, 1)
        return SlotStats(
            slot=sid,
            kind=info.kind,
            layer=info.layer,
            dtype=q.dtype,
            scale=f32_list(q.scale),
            zero_point=q.zero_point.tolist(),  # as in QParam.to_json
            rmin=None if q.rmin is None else f32_list(q.rmin),
            rmax=None if q.rmax is None else f32_list(q.rmax),
            elements=int(elems),
            sqnr_alone=alone.sqnr,
            cos_alone=alone.cos,
            sqnr_upstream=up.sqnr,
            cos_upstream=up.cos,
            clipped=float(clip),
        )


class _LoggedStats:
    """Stands for an :class:`ErrorStats` in a worker: logs ``(key, sums)`` of every add."""

    def __init__(self, key: tuple, log: list):
        self.key, self.log = key, log

    def add(self, ref, q) -> None:
        self.log.append((self.key, ErrorStats.sums(ref, q)))


#: the report's exact counters and how shards' values of them merge
_COUNTERS = {"slot_clip": sum, "slot_n": sum, "acc_max": max, "acc_ovf": sum, "acc_n": sum}


class _Tally:
    """The report's streaming sums: per slot and layer, alone and upstream. ``make(key)``
    creates each error statistic (default :class:`ErrorStats`); ``key`` is ``(field,
    slot or layer)``."""

    def __init__(self, act_slots, plans, acc_range, make=None):
        make = make or (lambda key: ErrorStats())
        self.output = make(("output", ""))
        self.slot_alone = {s: make(("slot_alone", s)) for s in act_slots}
        self.slot_up = {s: make(("slot_up", s)) for s in act_slots}
        self.slot_clip = dict.fromkeys(act_slots, 0)
        self.slot_n = dict.fromkeys(act_slots, 0)
        self.lay_alone = {p.name: make(("lay_alone", p.name)) for p in plans}
        self.lay_up = {p.name: make(("lay_up", p.name)) for p in plans}
        accumulating = [p.name for p in plans if p.acc is not None]
        self.acc_max = dict.fromkeys(accumulating, 0.0)
        self.acc_ovf = dict.fromkeys(accumulating, 0)
        self.acc_n = dict.fromkeys(accumulating, 0)
        self.lo, self.hi = acc_range

    def stats(self, key: tuple):
        field, name = key
        return self.output if field == "output" else getattr(self, field)[name]

    def counts(self) -> dict:
        return {f: dict(getattr(self, f)) for f in _COUNTERS}

    def merge_counts(self, counts: dict) -> None:
        for f, combine in _COUNTERS.items():
            mine = getattr(self, f)
            for k, v in counts[f].items():
                mine[k] = combine((mine[k], v))

    def slot(self, sid: str, ref, pre, qp) -> None:
        """``ref``: the fp32 tensor; ``pre``: the simulated graph's input to the quantize."""
        dq, _ = fake_quant(ref, qp)
        self.slot_alone[sid].add(ref, dq)
        dq, clipped = fake_quant(pre, qp)
        self.slot_up[sid].add(ref, dq)
        self.slot_clip[sid] += clipped
        self.slot_n[sid] += dq.size

    def layer(self, name: str, ref, up, alone, acc) -> None:
        self.lay_up[name].add(ref, up)
        self.lay_alone[name].add(ref, alone)
        if acc is not None:
            self.acc_max[name] = max(self.acc_max[name], float(np.abs(acc).max(initial=0.0)))
            self.acc_ovf[name] += int(np.count_nonzero((acc > self.hi) | (acc < self.lo)))
            self.acc_n[name] += acc.size

    def layer_stats(self, p: _LayerPlan, slots) -> LayerStats:
        up, alone = self.lay_up[p.name], self.lay_alone[p.name]
        return LayerStats(
            layer=p.name,
            pattern=p.pattern,
            index=p.index,
            slots=list(slots),
            elements=up.n,
            sqnr_alone=alone.sqnr,
            cos_alone=alone.cos,
            sqnr_upstream=up.sqnr,
            cos_upstream=up.cos,
            acc_max=self.acc_max.get(p.name),
            acc_overflow=self.acc_ovf.get(p.name),
            acc_elements=self.acc_n.get(p.name),
        )


def _qparams_for(mod, params, dataset, qparams_or_config, config, target):
    if isinstance(qparams_or_config, QParams):
        return qparams_or_config, config or Config()
    cfg = qparams_or_config if isinstance(qparams_or_config, Config) else config
    cfg = cfg or Config()
    if isinstance(cfg.fallback, AutoFallback):
        cfg = cfg.replace(fallback=cfg.fallback.fixed())
    sim = simulate(mod, params, cfg)
    return calibrate(sim, params, dataset, cfg, target=target), cfg


def analyze(
    mod: tvm.IRModule,
    params: dict | None,
    dataset,
    qparams_or_config: QParams | Config | None = None,
    *,
    config: Config | None = None,
    accumulator: str = "int16",
    target=None,
) -> Report:
    """Per-layer error analysis of ``mod`` quantized with ``qparams_or_config``.

    ``qparams_or_config``: calibrated :class:`QParams` (then ``config`` must be the config
    they were calibrated with, default ``Config()``), or a :class:`Config` (calibrated here
    on ``dataset`` first), or None (default config). ``dataset``: samples as for
    :func:`autoq.calibration` (usually the calibration data or a held-out part of it).
    ``accumulator``: the narrower accumulator dtype the overflow counts refer to.
    """
    target = target or default_target()
    qp, cfg = _qparams_for(mod, params, dataset, qparams_or_config, config, target)
    return Analysis(mod, params, dataset, qp, cfg, target, accumulator).report()
