"""Stage 2, calibrate: choose every slot's scale and zero point from data.

Weights are calibrated from the weight arrays themselves. Activations, in the default
``topological`` mode, are calibrated in topological order on values that already carry the
quantization error of every upstream choice, at the cost of **one** pass of the simulated
graph over the dataset:

1. the simulated ``main`` is cut into a prologue (everything that depends on weights only,
   computed once) and segments, one starting at each activation slot's quantize;
2. all of them are compiled once, in one module (qparams are runtime inputs);
3. the segments run in order over the whole dataset; the values still needed later are
   cached per sample (:class:`ValueCache`: RAM up to ``memory_budget_mb``, then ``.npy``
   files in ``cache_dir`` or a temporary directory) and freed after their last use;
4. before a segment runs, the observers of the slots it starts with see the cached input
   tensor of every sample, and compute the qparams the segment then uses.

``calibration="fp32"`` instead runs the float graph once (twice for histogram
calibrators, whose bins need the range first) with every slot's tensor as an output and
feeds the observers batch by batch, like ONNX Runtime does.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm

from . import calibrators
from .build import default_target
from .config import Config, QuantSpec
from .dataset import InputSpec, as_dataset
from .qparams import QParam, QParams
from .registry import slot_id_of
from .simulate import SimResult
from .toolkit import as_list, bindings, compile_vm, free_vars, make_function, slice_bindings

__all__ = ["ValueCache", "calibrate", "calibrate_weights", "default_target"]


# ------------------------------------------------------------------- dataset


def samples_for(dataset, inputs, cache: bool | str = "auto"):
    """The validated, repeatable view of ``dataset`` for a model's input Vars
    (see :func:`autoq.dataset.as_dataset`: errors name the input and the sample)."""
    specs = [
        InputSpec(v.name, tuple(int(d) for d in v.ty.shape.values), str(v.ty.dtype)) for v in inputs
    ]
    return as_dataset(dataset, specs, cache=cache)


# ------------------------------------------------------------------- observers


def observe(
    spec: QuantSpec,
    batches: Iterable[np.ndarray],
    axis: int | None,
    replay,
    channels: int | None = None,
) -> QParam:
    """Run ``spec.calibrator`` over the batches (a range pass first when it needs one).

    ``replay()`` returns a fresh iterable over the same batches (for the second pass).
    With ``axis``, a per-tensor result (e.g. from a user range function) is repeated for
    each of the ``channels`` channels."""
    cal = spec.calibrator
    data_range = None
    if getattr(cal, "needs_range", False):
        first = calibrators.range_observer(axis)  # mergeable, like every observer
        for x in batches:
            first.update(np.asarray(x))
        data_range = first.data_range()
        batches = replay()
    obs = cal.observer(axis=axis, data_range=data_range)
    for x in batches:
        obs.update(np.asarray(x))
    qp = obs.compute(spec)
    if axis is not None and (qp.axis != axis or qp.scale.ndim == 0):

        def rep(a):
            return (
                None
                if a is None
                else np.broadcast_to(a, (channels,)).copy()
                if np.ndim(a) == 0
                else a
            )

        qp = QParam(rep(qp.scale), rep(qp.zero_point), qp.dtype, axis, rep(qp.rmin), rep(qp.rmax))
    return qp


def calibrate_weights(sim: SimResult) -> dict[str, QParam]:
    """QParams of every weight slot, from the weight arrays (per channel where configured)."""
    out = {}
    for sid, (arr, axis) in sim.plan.weights.items():
        spec = sim.plan.specs[sid]
        channels = None if axis is None else arr.shape[axis]
        out[sid] = observe(spec, [arr], axis, lambda arr=arr: [arr], channels)
    return out


# ------------------------------------------------------------------ value cache


class ValueCache:
    """Per-sample values of graph variables, in RAM up to a budget, then on disk.

    Values are kept as numpy copies: a tensor returned by the VM can keep a whole pooled
    storage block alive (measured: 3.8x the tensor's size on PP-OCRv4), so holding VM
    outputs would blow the budget it accounts for."""

    def __init__(self, budget_bytes: float, cache_dir: str | None = None):
        self.budget = budget_bytes
        self.ram: dict[tuple, object] = {}
        self.disk: dict[tuple, Path] = {}
        self.nbytes = 0
        self.peak = 0
        self.spilled = 0
        self._dir_arg = cache_dir
        self._dir: Path | None = None
        self._own_dir = False

    def _path(self, key) -> Path:
        if self._dir is None:
            if self._dir_arg:
                self._dir = Path(self._dir_arg)
                self._dir.mkdir(parents=True, exist_ok=True)
            else:
                self._dir = Path(tempfile.mkdtemp(prefix="autoq-calib-"))
                self._own_dir = True
        return self._dir / f"v{abs(hash(key))}_{len(self.disk)}.npy"

    def put(self, key, value) -> None:
        arr = value.numpy() if hasattr(value, "numpy") else np.ascontiguousarray(value)
        nb = arr.nbytes
        if self.nbytes + nb <= self.budget:
            self.ram[key] = (arr, nb)
            self.nbytes += nb
            self.peak = max(self.peak, self.nbytes)
        else:
            p = self._path(key)
            np.save(p, arr)
            self.disk[key] = p
            self.spilled += nb

    def get(self, key):
        """The value as a tvm tensor (a fresh copy)."""
        return tvm.runtime.tensor(self.get_numpy(key))

    def get_numpy(self, key) -> np.ndarray:
        if key in self.ram:
            return self.ram[key][0]
        return np.load(self.disk[key], mmap_mode="r")

    def drop(self, key) -> None:
        if key in self.ram:
            self.nbytes -= self.ram.pop(key)[1]
        elif key in self.disk:
            self.disk.pop(key).unlink(missing_ok=True)

    def close(self) -> None:
        for p in self.disk.values():
            p.unlink(missing_ok=True)
        self.ram.clear()
        self.disk.clear()
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------- segmentation


@dataclass
class _Segment:
    name: str
    heads: list[str]  # activation slots whose quantize starts this segment
    bindings: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


def _plan(sim: SimResult):
    """Prologue (weight-only values), segments cut at activation quantizes, liveness."""
    func = sim.mod["main"]
    pairs = bindings(func)
    act_slots = sim.activation_slots()
    act_qvars = {v for s in act_slots for v in sim.qparam_vars[s]}
    names = {p.name: p for p in func.params}
    inputs = [names[v.name] for v in sim.graph.inputs]
    sq_slot = {sim.sq_vars[sid]: sid for sid in act_slots}
    dynamic_roots = set(inputs) | {names[v.name] for v in act_qvars}
    dynamic: set = set()
    for var, value in pairs:
        if any(u in dynamic or u in dynamic_roots for u in free_vars(value)):
            dynamic.add(var)
    # only what feeds an activation quantize is needed
    needed = {v for v, _ in slice_bindings(pairs, sq_slot)}
    prologue = [(v, e) for v, e in pairs if v in needed and v not in dynamic]
    segs: list[_Segment] = []
    for var, value in pairs:
        if var not in needed or var not in dynamic:
            continue
        if var in sq_slot:
            if not segs or (segs[-1].bindings and segs[-1].bindings[-1][0] not in sq_slot):
                segs.append(_Segment(f"seg_{len(segs)}", []))
            segs[-1].heads.append(sq_slot[var])
        elif not segs:
            segs.append(_Segment("seg_0", []))
        segs[-1].bindings.append((var, value))
    # inputs/outputs of every segment
    defined_in = {}
    for i, s in enumerate(segs):
        for v, _ in s.bindings:
            defined_in[v] = i
    last_use: dict = {}
    for i, s in enumerate(segs):
        seen = []
        for _, value in s.bindings:
            for u in free_vars(value):
                if defined_in.get(u) != i and not any(u.same_as(x) for x in seen):
                    seen.append(u)
                last_use[u] = i
        s.inputs = seen
    for i, s in enumerate(segs):
        s.outputs = [v for v, _ in s.bindings if last_use.get(v, -1) > i]
    prologue_vars = {v for v, _ in prologue}
    prologue_out = [v for v in prologue_vars if any(v in s.inputs for s in segs)]
    prologue_out.sort(key=lambda v: v.name)
    return func, inputs, prologue, prologue_out, segs, last_use, sq_slot


# ------------------------------------------------------------------- calibrate


def _progress(config: Config, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not config.progress, unit="step", leave=False)


def calibrate(
    sim: SimResult,
    params: dict | None,
    dataset,
    config: Config | None = None,
    target=None,
) -> QParams:
    """Choose the qparams of every slot of ``sim`` (see the module docstring).

    ``params`` are the weight arrays (the same dict given to ``simulate``; may be None when
    the weights were constants); ``dataset`` an iterable of ``{input: array}`` dicts or of
    arrays (single-input models), validated before any work.
    """
    config = config or Config()
    target = target or default_target()
    g = sim.graph
    samples = samples_for(dataset, g.inputs)
    t0 = time.perf_counter()
    result = calibrate_weights(sim)
    stats: dict[str, float] = {"weights_s": time.perf_counter() - t0}
    if config.calibration == "fp32":
        acts = _calibrate_fp32(sim, samples, config, target, stats)
    else:
        acts = _calibrate_topological(sim, samples, result, config, target, stats)
    stats["total_s"] = time.perf_counter() - t0
    result.update(acts)
    widened = fit_bias_scales(sim, result)
    return QParams(
        params={s: result[s] for s in sim.plan.slots},
        slots=dict(sim.plan.slots),
        meta={
            "calibration": config.calibration,
            "samples": samples.num_samples,
            "specs": {s: sp.to_json() for s, sp in sim.plan.specs.items()},
            "bias_widened": widened,
            "stats": {k: round(v, 4) for k, v in stats.items()},
        },
    )


#: |bias / (s_x * s_w)| must stay below this: the int32 bias then never saturates and the
#: simulated graph's float32 accumulator stays exact (see docs/design.md, "Fidelity").
BIAS_LIMIT = 2.0**22


def fit_bias_scales(sim: SimResult, result: dict[str, QParam]) -> list[str]:
    """Widen the weight scale of channels whose bias would not fit the accumulator.

    A channel with near-zero weights and a large bias (a dead or pruned filter) gets a tiny
    weight scale, and ``bias / (s_x * s_w)`` then overflows int32. Such channels get
    ``s_w = |bias| / (s_x * BIAS_LIMIT)``: their weights lose precision they did not have
    anyway, and the bias is kept. Applied once all qparams are known (the slots downstream
    were calibrated with the unwidened scale; the realized graph and the simulated graph
    with these final qparams still agree exactly). Returns the layers changed."""
    tensor_id = slot_id_of(sim.graph, sim.matches)
    changed = []
    for m in sim.matches:
        wsid = f"{m.layer}.weight"
        if "bias" not in m.nodes or wsid not in result:
            continue
        x = m["data"]
        xq = result.get(tensor_id(x))
        if xq is None:
            continue
        wq = result[wsid]
        bias = np.abs(np.asarray(sim.graph.weight_of(m["bias"]).array, np.float64).reshape(-1))
        need = (bias / (float(xq.scale) * BIAS_LIMIT)).astype(np.float32)
        if np.all(need <= wq.scale):
            continue
        # per-tensor weights: one scale that fits every channel's bias
        new = np.maximum(wq.scale, need if wq.scale.ndim else need.max()).astype(np.float32)
        result[wsid] = QParam(new, wq.zero_point, wq.dtype, wq.axis, wq.rmin, wq.rmax)
        changed.append(m.layer)
    return changed


def _calibrate_topological(sim, samples, weight_qp, config, target, stats) -> dict[str, QParam]:
    func, inputs, prologue, prologue_out, segs, last_use, sq_slot = _plan(sim)
    params_by_name = {p.name: p for p in func.params}
    g = sim.graph
    weight_vals = {}
    for p in g.weight_params:
        weight_vals[params_by_name[p.name]] = tvm.runtime.tensor(
            np.ascontiguousarray(g.params[p.name])
        )
    qvals: dict = {}
    for sid, qp in weight_qp.items():
        s, z = sim.qparam_vars[sid]
        qvals[params_by_name[s.name]] = tvm.runtime.tensor(qp.scale)
        qvals[params_by_name[z.name]] = tvm.runtime.tensor(qp.zero_point)
    pro_in = sorted(
        {u for _, e in prologue for u in free_vars(e) if u in params_by_name.values()},
        key=lambda v: v.name,
    )
    functions = {"prologue": make_function("prologue", pro_in, prologue, prologue_out)}
    for s in segs:
        functions[s.name] = make_function(s.name, s.inputs, s.bindings, s.outputs)
    t0 = time.perf_counter()
    vm = compile_vm(functions, target, sim.mod)
    stats["compile_s"] = time.perf_counter() - t0
    stats["segments"] = len(segs)
    run_s = observe_s = 0.0
    static = dict(weight_vals)
    static.update(qvals)
    pro_vals = as_list(vm["prologue"](*[static[v] for v in pro_in]))
    static.update(dict(zip(prologue_out, pro_vals, strict=True)))

    cache = ValueCache(config.memory_budget_mb * 2**20, config.cache_dir)
    result: dict[str, QParam] = {}
    try:
        for i, sample in enumerate(samples):
            for v in inputs:
                cache.put((v, i), sample[v.name])
        n = samples.num_samples
        sq_input = {}
        value_of = {v: e for s in segs for v, e in s.bindings}
        for var, sid in sq_slot.items():
            sq_input[sid] = value_of[var].args[0]
        bar = _progress(config, len(segs) * n, "calibrating")
        for j, seg in enumerate(segs):
            for sid in seg.heads:
                t = sq_input[sid]
                spec = sim.plan.specs[sid]

                def batches(t=t):
                    return (cache.get_numpy((t, i)) for i in range(n))

                t1 = time.perf_counter()
                qp = observe(spec, batches(), None, batches)
                observe_s += time.perf_counter() - t1
                result[sid] = qp
                s, z = sim.qparam_vars[sid]
                static[params_by_name[s.name]] = tvm.runtime.tensor(qp.scale)
                static[params_by_name[z.name]] = tvm.runtime.tensor(qp.zero_point)
            bar.set_postfix_str(",".join(seg.heads)[:40])
            f = vm[seg.name]
            t1 = time.perf_counter()
            for i in range(n):
                args = [static[v] if v in static else cache.get((v, i)) for v in seg.inputs]
                outs = as_list(f(*args))
                for v, o in zip(seg.outputs, outs, strict=True):
                    cache.put((v, i), o)
                bar.update(1)
            run_s += time.perf_counter() - t1
            for v in seg.inputs:
                if last_use.get(v) == j and v not in static:
                    for i in range(n):
                        cache.drop((v, i))
        bar.close()
        stats.update(
            run_s=run_s,
            observe_s=observe_s,
            cache_peak_mb=cache.peak / 2**20,
            spilled_mb=cache.spilled / 2**20,
        )
    finally:
        cache.close()
    missing = [s for s in sim.activation_slots() if s not in result]
    if missing:
        raise RuntimeError(f"internal error: activation slots {missing} were never calibrated")
    return result


def fp32_slot_runner(sim: SimResult, slots: list[str], target):
    """``run(samples)``: for each sample, the fp32 values of the tensors that the
    activation ``slots`` quantize (one compiled float graph with those tensors as outputs)."""
    g = sim.graph
    tensors = [sim.plan.tensors[s] for s in slots]
    params = list(g.inputs) + list(g.weight_params)
    fn = make_function("main", params, g.bindings, tensors)
    vm = compile_vm({"main": fn}, target, g.module)
    weights = [tvm.runtime.tensor(np.ascontiguousarray(g.params[p.name])) for p in g.weight_params]

    def run(samples):
        for sample in samples:
            feeds = [tvm.runtime.tensor(np.ascontiguousarray(sample[v.name])) for v in g.inputs]
            yield [o.numpy() for o in as_list(vm["main"](*feeds, *weights))]

    return run


def _calibrate_fp32(sim, samples, config, target, stats) -> dict[str, QParam]:
    slots = sim.activation_slots()
    t0 = time.perf_counter()
    run = fp32_slot_runner(sim, slots, target)
    stats["compile_s"] = time.perf_counter() - t0
    specs = [sim.plan.specs[s] for s in slots]
    needs = [getattr(sp.calibrator, "needs_range", False) for sp in specs]
    ranges: list = [None] * len(slots)
    if any(needs):
        lo = [None] * len(slots)
        hi = [None] * len(slots)
        for outs in run(samples):
            for k, x in enumerate(outs):
                if needs[k]:
                    lo[k] = x.min() if lo[k] is None else min(lo[k], x.min())
                    hi[k] = x.max() if hi[k] is None else max(hi[k], x.max())
        ranges = [(lo[k], hi[k]) if needs[k] else None for k in range(len(slots))]
    observers = [
        sp.calibrator.observer(axis=None, data_range=r) for sp, r in zip(specs, ranges, strict=True)
    ]
    for outs in run(samples):
        for obs, x in zip(observers, outs, strict=True):
            obs.update(x)
    return {s: obs.compute(sp) for s, obs, sp in zip(slots, observers, specs, strict=True)}
