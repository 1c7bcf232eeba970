"""Which layer hurts? Per-layer error analysis and the automatic fp32 / int16 fallback.

:func:`analyze` returns a :class:`Report`: for every quantized tensor (slot) and every layer,
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
  :mod:`autoq.simulate`), returning each slot's float input to its quantize, each layer's
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

**Automatic fallback** (:func:`search_fallback`, used by :func:`autoq.quantize` when
``config.fallback`` is an :class:`autoq.AutoFallback`): the layers are ranked by their
"alone" SQNR (or, ``ranking="revert"``, by the metric with only that layer reverted to fp32),
then ``k = 0, 1, 2, ...`` of the most sensitive are switched off in the same compiled
``sim`` function until the metric meets the budget. A trial is one run of that function
over the calibration samples: no recalibration, no recompilation. The chosen layers become an
ordinary ``Fallback(ids=...)`` (or int16 overrides) with the calibrated qparams carried over.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import tvm
from tvm import relax

from . import primitives as P
from .build import default_target
from .calibrate import _as_list, _bindings, _compile, _make_function, calibrate, samples_for
from .config import AutoFallback, Config, Fallback, Override, QuantSpec
from .graph import free_vars
from .qparams import QParam, QParams, _f32_list
from .simulate import SimResult, simulate

__all__ = [
    "Analysis",
    "FallbackDecision",
    "LayerStats",
    "Report",
    "SlotStats",
    "analyze",
    "search_fallback",
]

#: below this |accumulator| the simulated graph (float32 integers) is exact
EXACT_LIMIT = 2**24


# ----------------------------------------------------------------------------- statistics


class _Err:
    """Streaming SQNR / cosine of ``q`` against ``ref`` (float64 sums)."""

    __slots__ = ("dot", "err2", "n", "q2", "ref2")

    def __init__(self):
        self.n = 0
        self.ref2 = self.err2 = self.q2 = self.dot = 0.0

    def add(self, ref, q) -> None:
        r = np.asarray(ref, np.float64).ravel()
        t = np.asarray(q, np.float64).ravel()
        d = r - t
        self.n += r.size
        self.ref2 += float(r @ r)
        self.err2 += float(d @ d)
        self.q2 += float(t @ t)
        self.dot += float(r @ t)

    @property
    def sqnr(self) -> float:
        if self.n == 0:
            return float("nan")
        if self.err2 == 0.0:
            return float("inf")
        if self.ref2 == 0.0:
            return float("-inf")
        return 10.0 * math.log10(self.ref2 / self.err2)

    @property
    def cos(self) -> float:
        if self.n == 0:
            return float("nan")
        if self.ref2 == 0.0 or self.q2 == 0.0:
            return 1.0 if self.ref2 == self.q2 else 0.0
        return self.dot / math.sqrt(self.ref2 * self.q2)


def sqnr_db(ref: Sequence, test: Sequence) -> float:
    """SQNR in dB of ``test`` against ``ref`` (sequences of arrays or lists of arrays)."""
    e = _Err()
    for r, t in zip(ref, test, strict=True):
        for a, b in zip(_flat_outputs(r), _flat_outputs(t), strict=True):
            e.add(a, b)
    return e.sqnr


def _flat_outputs(o) -> list:
    return list(o) if isinstance(o, list | tuple) else [o]


def _fake_quant(x: np.ndarray, qp: QParam):
    """(dequantized values, number clipped) for ``x`` quantized with ``qp`` (bit-exact with
    :func:`autoq.primitives.quantize` / ``dequantize``)."""
    qmin, qmax = P.qrange(qp.dtype)
    x = np.asarray(x, np.float32)
    if qp.axis is not None and qp.scale.ndim == 1:
        shape = [1] * x.ndim
        shape[qp.axis] = -1
        s = qp.scale.reshape(shape)
        z = qp.zero_point.reshape(shape).astype(np.float32)
    else:
        s = np.float32(qp.scale.reshape(-1)[0])
        z = np.float32(qp.zero_point.reshape(-1)[0])
    v = np.rint(x / s) + z
    clipped = int(np.count_nonzero((v < qmin) | (v > qmax)))
    v = np.clip(v, qmin, qmax)
    return ((v - z) * s).astype(np.float32), clipped


# --------------------------------------------------------------------------------- report


def _num(v):
    """JSON-safe float (inf / nan as strings) and back."""
    if v is None:
        return None
    if isinstance(v, str):
        return float(v)
    v = float(v)
    return v if math.isfinite(v) else str(v)


def _nums(v):
    if v is None:
        return None
    if isinstance(v, list | tuple | np.ndarray):
        return [_num(x) for x in np.asarray(v).ravel().tolist()]
    return _num(v)


def _from_nums(v):
    if v is None:
        return None
    if isinstance(v, list):
        return [float(x) for x in v]
    return float(v)


@dataclass
class SlotStats:
    """One quantized tensor. ``scale`` / ``zero_point`` / ``rmin`` / ``rmax``: floats
    (per-tensor) or lists (per-channel). ``clipped``: fraction of the values (upstream run)
    outside the integer range. Weights have equal alone and upstream numbers."""

    slot: str
    kind: str
    layer: str
    dtype: str
    scale: Any
    zero_point: Any
    rmin: Any
    rmax: Any
    elements: int
    sqnr_alone: float
    cos_alone: float
    sqnr_upstream: float
    cos_upstream: float
    clipped: float

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("scale", "rmin", "rmax", "sqnr_alone", "cos_alone", "sqnr_upstream"):
            d[k] = _nums(d[k])
        d["cos_upstream"] = _num(d["cos_upstream"])
        d["clipped"] = _num(d["clipped"])
        return d

    @classmethod
    def from_json(cls, d: dict) -> SlotStats:
        d = dict(d)
        for k in ("scale", "rmin", "rmax", "sqnr_alone", "cos_alone", "sqnr_upstream"):
            d[k] = _from_nums(d[k])
        d["cos_upstream"] = _from_nums(d["cos_upstream"])
        d["clipped"] = _from_nums(d["clipped"])
        return cls(**d)


@dataclass
class LayerStats:
    """One layer: SQNR / cosine of its output, alone and upstream; ``acc_max`` is the
    largest |int32 accumulator| seen (upstream run; None for layers that do not
    accumulate), ``acc_overflow`` how many accumulator values fall outside the narrower
    ``Report.accumulator`` dtype, of ``acc_elements``."""

    layer: str
    pattern: str
    index: int
    slots: list[str]
    elements: int
    sqnr_alone: float
    cos_alone: float
    sqnr_upstream: float
    cos_upstream: float
    acc_max: float | None = None
    acc_overflow: int | None = None
    acc_elements: int | None = None

    @property
    def exact(self) -> bool:
        """The simulated graph predicts this layer bit for bit (|acc| < 2**24)."""
        return self.acc_max is None or self.acc_max < EXACT_LIMIT

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("sqnr_alone", "cos_alone", "sqnr_upstream", "cos_upstream", "acc_max"):
            d[k] = _num(d[k])
        return d

    @classmethod
    def from_json(cls, d: dict) -> LayerStats:
        d = dict(d)
        for k in ("sqnr_alone", "cos_alone", "sqnr_upstream", "cos_upstream", "acc_max"):
            d[k] = _from_nums(d[k])
        return cls(**d)


@dataclass
class Report:
    """The result of :func:`analyze`: ``layers`` in topological order, ``slots`` in slot
    order, the model output's SQNR / cosine (everything quantized), the narrow accumulator
    dtype the overflow counts refer to, and the number of samples."""

    layers: list[LayerStats]
    slots: list[SlotStats]
    output_sqnr: float
    output_cos: float
    accumulator: str = "int16"
    samples: int = 0
    meta: dict = field(default_factory=dict)

    def layer(self, name: str) -> LayerStats:
        for s in self.layers:
            if s.layer == name:
                return s
        raise KeyError(f"no layer {name!r}; layers: {[s.layer for s in self.layers]}")

    def slot(self, name: str) -> SlotStats:
        for s in self.slots:
            if s.slot == name:
                return s
        raise KeyError(f"no slot {name!r}")

    def ranked(self) -> list[LayerStats]:
        """Layers by damage: lowest "alone" SQNR first (the error the layer itself adds);
        ties by upstream SQNR, then topological order."""
        return sorted(
            self.layers, key=lambda s: (_key(s.sqnr_alone), _key(s.sqnr_upstream), s.index)
        )

    def table(self, sort: str = "damage") -> str:
        """A text table of the layers (``sort``: ``"damage"`` or ``"topological"``)."""
        rows = self.ranked() if sort == "damage" else list(self.layers)
        head = (
            f"{'#':>3} {'layer':<32} {'pattern':<16} {'SQNR alone':>10} {'cos alone':>9} "
            f"{'SQNR up':>8} {'cos up':>8} {'in clip%':>8} {'max|acc|':>10} "
            f"{'>' + self.accumulator:>9}"
        )
        lines = [head, "-" * len(head)]
        slot_by = {s.slot: s for s in self.slots}
        for r in rows:
            ins = [slot_by[s] for s in r.slots if s in slot_by and slot_by[s].kind == "activation"]
            clip = max((s.clipped for s in ins), default=0.0)
            acc = "" if r.acc_max is None else f"{r.acc_max:.0f}" + ("" if r.exact else "!")
            ovf = "" if r.acc_overflow is None else str(r.acc_overflow)
            lines.append(
                f"{r.index:>3} {r.layer[:32]:<32} {r.pattern[:16]:<16} {_f(r.sqnr_alone):>10} "
                f"{r.cos_alone:>9.5f} {_f(r.sqnr_upstream):>8} {r.cos_upstream:>8.5f} "
                f"{100 * clip:>8.3f} {acc:>10} {ovf:>9}"
            )
        lines.append(
            f"model output: SQNR {_f(self.output_sqnr)} dB, cos {self.output_cos:.6f} "
            f"({self.samples} samples; '!' = |acc| >= 2**24, the simulated graph is not exact)"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> dict:
        return {
            "format": "autoq.report",
            "version": 1,
            "accumulator": self.accumulator,
            "samples": self.samples,
            "output_sqnr": _num(self.output_sqnr),
            "output_cos": _num(self.output_cos),
            "layers": [s.to_json() for s in self.layers],
            "slots": [s.to_json() for s in self.slots],
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: dict) -> Report:
        if d.get("format") != "autoq.report":
            raise ValueError("not an autoq report (format != 'autoq.report')")
        return cls(
            layers=[LayerStats.from_json(x) for x in d["layers"]],
            slots=[SlotStats.from_json(x) for x in d["slots"]],
            output_sqnr=_from_nums(d["output_sqnr"]),
            output_cos=_from_nums(d["output_cos"]),
            accumulator=d.get("accumulator", "int16"),
            samples=int(d.get("samples", 0)),
            meta=dict(d.get("meta", {})),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def loads(cls, s: str) -> Report:
        return cls.from_json(json.loads(s))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.dumps())
        return path

    def plot(self, path: str | Path, title: str | None = None) -> Path | None:
        """PNG of the SQNR per layer in topological order (alone and upstream). Needs
        matplotlib (``pip install autoq[plot]``); without it, warns and returns None."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            warnings.warn(
                "Report.plot needs matplotlib (pip install 'autoq[plot]'); no PNG written",
                stacklevel=2,
            )
            return None
        path = Path(path)
        xs = np.arange(len(self.layers))
        cap = 100.0

        def clipv(v):
            return min(v, cap) if math.isfinite(v) or v > 0 else 0.0

        fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(xs) + 2), 4.2))
        ax.plot(xs, [clipv(s.sqnr_alone) for s in self.layers], "o-", ms=3, label="alone")
        ax.plot(xs, [clipv(s.sqnr_upstream) for s in self.layers], "s-", ms=3, label="upstream")
        ax.set_xticks(xs)
        ax.set_xticklabels([s.layer for s in self.layers], rotation=90, fontsize=6)
        ax.set_ylabel("SQNR (dB)")
        ax.set_title(title or f"per-layer SQNR (output {_f(self.output_sqnr)} dB)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def _key(v: float) -> float:
    return float("inf") if v != v else v


def _f(v: float) -> str:
    return f"{v:.2f}" if math.isfinite(v) else str(v)


# ------------------------------------------------------------------------------- analysis


def _is_call(expr, name: str) -> bool:
    return isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _output_fields(expr) -> list:
    if isinstance(expr, relax.Tuple):
        return list(expr.fields)
    return [expr]


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


class Analysis:
    """The compiled analysis of one model + qparams (see the module docstring): build it
    once, then :meth:`report` and any number of :meth:`run` trials."""

    def __init__(
        self,
        mod: tvm.IRModule,
        params: dict | None,
        dataset,
        qparams: QParams,
        config: Config | None = None,
        target=None,
        accumulator: str = "int16",
    ):
        t0 = time.perf_counter()
        self.config = config or Config()
        self.target = target or default_target()
        self.qparams = qparams
        P.qrange(accumulator)
        self.accumulator = accumulator
        sim = simulate(mod, params, self._sim_config(), switches=True)
        self.sim: SimResult = sim
        g = sim.graph
        missing = [s for s in sim.slots if s not in qparams]
        if missing:
            raise KeyError(
                f"the qparams lack slots {missing[:5]} of this model/config: calibrate with the "
                "same config"
            )
        self.samples = samples_for(dataset, g.inputs)
        func = sim.mod["main"]
        bindings = _bindings(func)
        value_of = dict(bindings)
        self.layers = [m.layer for m in sim.matches]
        self._weights = {
            p.name: tvm.runtime.tensor(np.ascontiguousarray(g.params[p.name]))
            for p in g.weight_params
        }
        self._qvals: dict[str, tvm.runtime.Tensor] = {}
        for sid, (s, z) in sim.qparam_vars.items():
            self._qvals[s.name] = tvm.runtime.tensor(np.asarray(qparams[sid].scale, np.float32))
            self._qvals[z.name] = tvm.runtime.tensor(np.asarray(qparams[sid].zero_point, np.int32))
        self._on = tvm.runtime.tensor(np.float32(1.0))
        self._off = tvm.runtime.tensor(np.float32(0.0))
        out_fields = _output_fields(g.output)
        self.n_out = len(out_fields)

        # ---- fp32 function: model outputs + every tensor the analysis compares or feeds
        act_slots = sim.activation_slots()
        self.act_slots = act_slots
        stop = {
            sv: v
            for v, sv in sim.values.items()
            if isinstance(sv, relax.Var) and g.is_data_dependent(v)
        }
        for v in g.inputs:
            stop[v] = v
        plans: list[_LayerPlan] = []
        for i, m in enumerate(sim.matches):
            sroot = sim.values[m.root]
            acc = None
            rv = value_of.get(sroot)
            if _is_call(rv, "qnn.simulated_dequantize") and isinstance(rv.args[0], relax.Var):
                a = rv.args[0]
                if a in value_of and not _is_call(value_of[a], "qnn.simulated_quantize"):
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
        self._plans = plans
        fp_vars: list = []
        for sid in act_slots:
            fp_vars.append(sim.plan.tensors[sid])
        for p in plans:
            fp_vars.append(p.root)
            fp_vars.extend(f[1] for f in p.feeds if f[0] == "fp32")
        self._fp_vars = list(dict.fromkeys(fp_vars))  # Vars hash and compare by identity
        fp_params = list(g.inputs) + list(g.weight_params)
        functions = {
            "fp32": _make_function("fp32", fp_params, g.bindings, out_fields + self._fp_vars)
        }

        # ---- sim function: model outputs + slot pre-quantize inputs + layer outputs / accs
        self._pre = []
        for sid in act_slots:
            self._pre.append(value_of[sim.sq_vars[sid]].args[0])
        sim_outs = (
            list(_output_fields(func.body.body))
            + self._pre
            + [p.sim_root for p in plans]
            + [p.acc for p in plans if p.acc is not None]
        )
        self._sim_params = list(func.params)
        functions["sim"] = _make_function("sim", self._sim_params, bindings, sim_outs)
        for p in plans:
            functions[f"layer_{p.index}"] = _make_function(
                f"layer_{p.index}", p.inputs, _segment(bindings, p, value_of), p.outputs
            )
        t1 = time.perf_counter()
        self.vm = _compile(functions, self.target, sim.mod)
        self.timings = {"build_s": t1 - t0, "compile_s": time.perf_counter() - t1}
        self._fp32_outputs: list | None = None

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

    # ---- public
    def run(self, disabled: Iterable[str] = (), samples=None) -> list:
        """Model outputs of the calibrated simulated graph with the ``disabled`` layers in
        fp32, one per sample (an array, or a list for several outputs); ``samples``
        defaults to the analysis dataset."""
        disabled = set(disabled)
        unknown = disabled - set(self.layers)
        if unknown:
            raise ValueError(f"unknown layers {sorted(unknown)}")
        data = self.samples if samples is None else samples_for(samples, self.sim.graph.inputs)
        f = self.vm["sim"]
        return [_as_outputs(_as_list(f(*self._sim_args(s, disabled))), self.n_out) for s in data]

    def run_fp32(self, samples=None) -> list:
        """Model outputs of the fp32 graph (cached for the analysis dataset)."""
        if samples is None and self._fp32_outputs is not None:
            return self._fp32_outputs
        data = self.samples if samples is None else samples_for(samples, self.sim.graph.inputs)
        f = self.vm["fp32"]
        outs = [_as_outputs(_as_list(f(*self._fp32_args(s))), self.n_out) for s in data]
        if samples is None:
            self._fp32_outputs = outs
        return outs

    def runner(self, disabled: Iterable[str] = ()) -> Callable:
        """``run(samples) -> outputs`` for a metric callable (``disabled`` layers fp32)."""
        disabled = tuple(disabled)
        return lambda samples: self.run(disabled, samples)

    def report(self) -> Report:
        """Run the analysis over the dataset (see the module docstring)."""
        t0 = time.perf_counter()
        sim = self.sim
        qp = self.qparams
        nfp = len(self._fp_vars)
        slot_alone = {s: _Err() for s in self.act_slots}
        slot_up = {s: _Err() for s in self.act_slots}
        slot_clip = dict.fromkeys(self.act_slots, 0)
        slot_n = dict.fromkeys(self.act_slots, 0)
        lay_alone = {p.name: _Err() for p in self._plans}
        lay_up = {p.name: _Err() for p in self._plans}
        acc_max = {p.name: 0.0 for p in self._plans if p.acc is not None}
        acc_ovf = {p.name: 0 for p in self._plans if p.acc is not None}
        acc_n = {p.name: 0 for p in self._plans if p.acc is not None}
        lo, hi = P.qrange(self.accumulator)
        out_err = _Err()
        fp32_outs = []
        fsim, ffp = self.vm["sim"], self.vm["fp32"]
        n = 0
        for sample in self.samples:
            n += 1
            fo = _as_list(ffp(*self._fp32_args(sample)))
            fp_out = [o.numpy() for o in fo[: self.n_out]]
            fp32_outs.append(fp_out[0] if self.n_out == 1 else fp_out)
            fpv = dict(zip(self._fp_vars, fo[self.n_out : self.n_out + nfp], strict=True))
            so = _as_list(fsim(*self._sim_args(sample)))
            k = self.n_out
            for a, b in zip(fp_out, so[:k], strict=True):
                out_err.add(a, b.numpy())
            pre = so[k : k + len(self.act_slots)]
            k += len(self.act_slots)
            roots = so[k : k + len(self._plans)]
            k += len(self._plans)
            accs = so[k:]
            for sid, pv in zip(self.act_slots, pre, strict=True):
                ref = fpv[sim.plan.tensors[sid]].numpy()
                dq, _ = _fake_quant(ref, qp[sid])
                slot_alone[sid].add(ref, dq)
                dq, clipped = _fake_quant(pv.numpy(), qp[sid])
                slot_up[sid].add(ref, dq)
                slot_clip[sid] += clipped
                slot_n[sid] += dq.size
            ai = 0
            for p, rv in zip(self._plans, roots, strict=True):
                ref = fpv[p.root].numpy()
                lay_up[p.name].add(ref, rv.numpy())
                if p.acc is not None:
                    a = accs[ai].numpy()
                    ai += 1
                    acc_max[p.name] = max(acc_max[p.name], float(np.abs(a).max(initial=0.0)))
                    acc_ovf[p.name] += int(np.count_nonzero((a > hi) | (a < lo)))
                    acc_n[p.name] += a.size
                args = [fpv[f[1]] if f[0] == "fp32" else self._param_value(f[1]) for f in p.feeds]
                seg = _as_list(self.vm[f"layer_{p.index}"](*args))
                lay_alone[p.name].add(ref, seg[0].numpy())
        self._fp32_outputs = fp32_outs
        slots = []
        for sid, info in sim.slots.items():
            q = qp[sid]
            if info.kind == "weight":
                arr, _axis = sim.plan.weights[sid]
                dq, clipped = _fake_quant(arr, q)
                e = _Err()
                e.add(arr, dq)
                sa, ca, su, cu, clip, elems = (
                    e.sqnr,
                    e.cos,
                    e.sqnr,
                    e.cos,
                    clipped / arr.size,
                    arr.size,
                )
            else:
                sa, ca = slot_alone[sid].sqnr, slot_alone[sid].cos
                su, cu = slot_up[sid].sqnr, slot_up[sid].cos
                elems = slot_n[sid]
                clip = slot_clip[sid] / max(elems, 1)
            slots.append(
                SlotStats(
                    slot=sid,
                    kind=info.kind,
                    layer=info.layer,
                    dtype=q.dtype,
                    scale=_f32_list(q.scale),
                    zero_point=q.zero_point.tolist(),  # as in QParam.to_json
                    rmin=None if q.rmin is None else _f32_list(q.rmin),
                    rmax=None if q.rmax is None else _f32_list(q.rmax),
                    elements=int(elems),
                    sqnr_alone=sa,
                    cos_alone=ca,
                    sqnr_upstream=su,
                    cos_upstream=cu,
                    clipped=float(clip),
                )
            )
        layers = [
            LayerStats(
                layer=p.name,
                pattern=p.pattern,
                index=p.index,
                slots=list(sim.layer_slots.get(p.name, [])),
                elements=lay_up[p.name].n,
                sqnr_alone=lay_alone[p.name].sqnr,
                cos_alone=lay_alone[p.name].cos,
                sqnr_upstream=lay_up[p.name].sqnr,
                cos_upstream=lay_up[p.name].cos,
                acc_max=acc_max.get(p.name),
                acc_overflow=acc_ovf.get(p.name),
                acc_elements=acc_n.get(p.name),
            )
            for p in self._plans
        ]
        self.timings["report_s"] = time.perf_counter() - t0
        return Report(
            layers=layers,
            slots=slots,
            output_sqnr=out_err.sqnr,
            output_cos=out_err.cos,
            accumulator=self.accumulator,
            samples=n,
            meta={"timings": dict(self.timings)},
        )


def _segment(bindings, plan: _LayerPlan, value_of) -> list:
    """The bindings of the simulated graph that compute ``plan.outputs`` from its inputs."""
    inputs = set(plan.inputs)
    needed: set = set()
    stack = list(plan.outputs)
    while stack:
        v = stack.pop()
        if v in needed or v in inputs or v not in value_of:
            continue
        needed.add(v)
        stack.extend(free_vars(value_of[v]))
    return [(v, e) for v, e in bindings if v in needed]


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
    :func:`autoq.calibrate` (usually the calibration data or a held-out part of it).
    ``accumulator``: the narrower accumulator dtype the overflow counts refer to.
    """
    target = target or default_target()
    qp, cfg = _qparams_for(mod, params, dataset, qparams_or_config, config, target)
    return Analysis(mod, params, dataset, qp, cfg, target, accumulator).report()


# ----------------------------------------------------------------------- automatic fallback


@dataclass
class FallbackDecision:
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

    def fallback(self, base: Fallback | None = None) -> Fallback:
        """The plain :class:`Fallback` that realizes this decision (``precision="fp32"``)."""
        base = base.fixed() if isinstance(base, AutoFallback) else (base or Fallback())
        if self.precision != "fp32":
            return base
        return Fallback(
            tuple(base.ids) + tuple(self.layers), base.op_types, base.patterns, base.validate
        )

    def config(self, config: Config) -> Config:
        """``config`` with the decision applied (fallback ids or int16 overrides)."""
        overrides = tuple(config.overrides)
        if self.precision == "int16":
            overrides = _int16_overrides(config, self.layers)
        return config.replace(fallback=self.fallback(config.fallback), overrides=overrides)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("metric", "reference", "int16_metric"):
            d[k] = _num(d[k])
        d["trials"] = [dict(t, metric=_num(t["metric"])) for t in self.trials]
        d["ranking"] = [dict(r, score=_num(r["score"])) for r in self.ranking]
        return d

    @classmethod
    def from_json(cls, d: dict) -> FallbackDecision:
        d = dict(d)
        for k in ("metric", "reference", "int16_metric"):
            d[k] = _from_nums(d.get(k))
        d["trials"] = [dict(t, metric=_from_nums(t["metric"])) for t in d["trials"]]
        d["ranking"] = [dict(r, score=_from_nums(r["score"])) for r in d["ranking"]]
        return cls(**d)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def loads(cls, s: str) -> FallbackDecision:
        return cls.from_json(json.loads(s))

    def summary(self) -> str:
        what = "fp32" if self.precision == "fp32" else "int16 activations"
        lines = [
            f"{len(self.layers)} layer(s) in {what}: {', '.join(self.layers) or '-'}; "
            f"{self.metric_name} {_f(self.metric)} ({self.budget}: "
            f"{'met' if self.met else 'NOT met'}); {self.evaluations} runs, {self.seconds:.1f} s"
        ]
        for r in self.ranking[: max(len(self.layers), 1) + 2]:
            mark = "*" if r["layer"] in self.layers else " "
            lines.append(f" {mark} {r['layer']}: {r['reason']}")
        return "\n".join(lines)


def _int16_spec(act: QuantSpec) -> QuantSpec:
    return QuantSpec(
        dtype="int16",
        symmetric=act.symmetric,
        narrow_range=act.narrow_range,
        reduce_range=act.reduce_range,
        per_channel=False,
        calibrator=act.calibrator,
    )


def _int16_overrides(config: Config, layers: Sequence[str]) -> tuple[Override, ...]:
    """``config.overrides`` plus int16 activation overrides for ``layers``."""
    spec = _int16_spec(config.activation)
    return (*config.overrides, *(Override(layer, activation=spec) for layer in layers))


def _evaluator(an: Analysis, fb: AutoFallback):
    """(name, reference, score(disabled_layers), within(score), budget text) for
    ``fb.metric``."""
    if fb.metric == "sqnr":
        ref_outs = an.run_fp32()

        def score_sqnr(disabled):
            return sqnr_db(ref_outs, an.run(disabled))

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


def search_fallback(
    an: Analysis, fb: AutoFallback, report: Report | None = None
) -> FallbackDecision:
    """Rank the layers of ``an`` and find the fewest to keep in fp32 (module docstring)."""
    t0 = time.perf_counter()
    report = report or an.report()
    name, reference, score, within, budget = _evaluator(an, fb)
    trials: list[dict] = []

    def trial(layers: list[str]) -> float:
        v = score(layers)
        trials.append({"k": len(layers), "layers": list(layers), "metric": v, "met": within(v)})
        return v

    base = trial([])
    if fb.ranking == "revert":
        scored = []
        for s in report.layers:
            v = score([s.layer])
            scored.append((s, v))
        # most improvement first (higher metric when reverted)
        scored.sort(key=lambda t: (-_key(t[1]), t[0].index))
        ranking = [
            {
                "layer": s.layer,
                "score": v,
                "reason": f"{name} {_f(v)} with this layer alone in fp32 "
                f"(all int8: {_f(base)}; its own SQNR {_f(s.sqnr_alone)} dB)",
            }
            for s, v in scored
        ]
    else:
        ranking = [
            {
                "layer": s.layer,
                "score": s.sqnr_alone,
                "reason": f"SQNR {_f(s.sqnr_alone)} dB when only this layer is quantized "
                f"(cos {s.cos_alone:.5f}); {_f(s.sqnr_upstream)} dB with everything upstream",
            }
            for s in report.ranked()
        ]
    order = [r["layer"] for r in ranking]
    # k: the chosen number of fp32 layers (the first within budget, else the best trial)
    k, value, met = 0, base, within(base)
    if not met:
        for n in range(1, min(fb.max_fp32_layers, len(order)) + 1):
            v = trial(order[:n])
            if within(v):
                k, value, met = n, v, True
                break
            if _key(v) > _key(value):
                k, value = n, v
    layers = order[:k]
    if not met:
        warnings.warn(
            f"AutoFallback: {budget} not reached with up to {fb.max_fp32_layers} fp32 layers; "
            f"using the best trial ({k} layers, {name} {_f(value)})",
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
        q = qparams[old]
        spec = dst.plan.specs[sid]
        if spec.dtype != q.dtype:
            lo = q.rmin if q.rmin is not None else P.dequantize(q.qmin, q.scale, q.zero_point)
            hi = q.rmax if q.rmax is not None else P.dequantize(q.qmax, q.scale, q.zero_point)
            q = QParam.from_range(
                lo,
                hi,
                spec.dtype,
                spec.symmetric,
                spec.narrow_range,
                spec.reduce_range,
                axis=q.axis,
            )
        out[sid] = q
    meta = dict(qparams.meta)
    meta["specs"] = {s: sp.to_json() for s, sp in dst.plan.specs.items()}
    return QParams(params=out, slots=dict(dst.slots), meta=meta)


def auto_fallback(
    mod: tvm.IRModule,
    params: dict | None,
    dataset,
    config: Config,
    qparams: QParams | None = None,
    target=None,
) -> tuple[Config, QParams, FallbackDecision, Report]:
    """Run :class:`AutoFallback` end to end: calibrate (unless ``qparams`` are given),
    analyze, search, and (``precision="int16"``) check the int16 alternative. Returns the
    config to realize with (a plain ``Fallback`` / int16 overrides), its qparams, the
    decision and the analysis report."""
    fb = config.fallback
    if not isinstance(fb, AutoFallback):
        raise TypeError("config.fallback must be an AutoFallback")
    target = target or default_target()
    base_cfg = config.replace(fallback=fb.fixed())
    sim = simulate(mod, params, base_cfg)
    if qparams is None:
        qparams = calibrate(sim, params, dataset, base_cfg, target=target)
    an = Analysis(mod, params, dataset, qparams, base_cfg, target)
    report = an.report()
    decision = search_fallback(an, fb, report)
    final_cfg = decision.config(base_cfg)
    final_qp = None
    if fb.precision == "int16" and decision.layers:
        t0 = time.perf_counter()
        cfg16 = base_cfg.replace(overrides=_int16_overrides(base_cfg, decision.layers))
        sim16 = simulate(mod, params, cfg16)
        qp16 = remap_qparams(sim, qparams, sim16)
        an16 = Analysis(mod, params, dataset, qp16, cfg16, target)
        _name, _ref, score, within, _b = _evaluator(an16, fb)
        v16 = score([])
        ok16 = within(v16)
        decision.int16_metric = v16
        decision.evaluations += 1
        decision.trials.append(
            {"k": len(decision.layers), "layers": list(decision.layers), "metric": v16,
             "met": ok16, "precision": "int16"}
        )  # fmt: skip
        if ok16 or (not decision.met and _key(v16) >= _key(decision.metric)):
            decision.precision = "int16"
            decision.metric = v16
            decision.met = ok16
            final_cfg, final_qp = cfg16, qp16
        decision.seconds += time.perf_counter() - t0
    if final_qp is None:
        final_qp = remap_qparams(sim, qparams, simulate(mod, params, final_cfg))
    final_qp.meta["fallback"] = decision.to_json()
    return final_cfg, final_qp, decision, report
