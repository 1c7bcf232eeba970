"""Stage 2, calibrate: choose every slot's scale and zero point from data.

Weights are calibrated from the weight arrays themselves. Activations, in the default
``topological`` mode, are calibrated in topological order on values that already carry the
quantization error of every upstream choice, at the cost of **one** pass of the simulated
graph over the dataset:

1. the simulated ``main`` is cut into a prologue (everything that depends on weights only,
   computed once) and segments, one starting at each activation slot's quantize
   (:mod:`autoq.calibration_plan`);
2. all of them are compiled once, in one module (qparams are runtime inputs), each
   reduction kernel (conv, matmul, pooling) with a cheap vectorized, parallel schedule that
   gives the same bits (:mod:`autoq.loop_schedule`);
3. a :class:`autoq.shard_runner.ShardRunner` holds the samples and runs the segments in
   order over all of them; the values still needed later are cached per sample
   (:class:`autoq.value_cache.ValueCache`: RAM up to ``memory_budget_mb``, then ``.npy``
   files in ``cache_dir`` or a temporary directory) and freed after their last use;
4. before a segment runs, the coordinator (:func:`run_plan`) asks the runner for the
   statistics of the slots it starts with (their cached input tensor on every sample) and
   computes the qparams the segment then uses (:func:`choose_qparams`). With several
   runners (one per shard of the data), their statistics merge exactly first.

``calibration="fp32"`` instead runs the float graph once (twice for histogram
calibrators, whose bins need the range first) with every slot's tensor as an output and
feeds the observers batch by batch, like ONNX Runtime does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import tvm

from . import calibrators
from .build import default_target
from .calibration_plan import CalibrationPlan, build_plan
from .config import Config, QuantSpec
from .dataset import InputSpec, as_dataset
from .loop_schedule import pipeline_with_loop_schedule
from .qparams import QParam, QParams
from .registry import slot_id_of
from .shard_runner import ShardRunner
from .simulate import SimResult
from .toolkit import as_list, compile_vm, make_function

__all__ = [
    "calibrate",
    "calibrate_weights",
    "choose_qparams",
    "fp32_slot_runner",
    "observe",
    "run_plan",
    "samples_for",
]


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


def _static_values(sim: SimResult, plan: CalibrationPlan, weight_qp: dict) -> dict:
    """key -> array: the weights and the weight qparams (inputs of the prologue)."""
    g = sim.graph
    static = {k: g.params[name] for k, name in plan.weight_keys.items()}
    for sid, qp in weight_qp.items():
        s_key, z_key = plan.qparam_keys[sid]
        static[s_key], static[z_key] = qp.scale, qp.zero_point
    return static


def _merged(observers: list):
    """One observer holding the exact merge of the shards' observers."""
    first = observers[0]
    for o in observers[1:]:
        first.merge(o)
    return first


def choose_qparams(runners: list, slot: str, spec: QuantSpec) -> QParam:
    """``slot``'s qparams from the merged statistics of every shard (a range pass first
    for histogram calibrators): the only place activation qparams are chosen."""
    cal = spec.calibrator
    data_range = None
    if getattr(cal, "needs_range", False):
        data_range = _merged([r.range_observer(slot) for r in runners]).data_range()
    return _merged([r.observer(slot, cal, data_range) for r in runners]).compute(spec)


def run_plan(
    plan: CalibrationPlan, runners: list, specs: dict, config: Config, sim: SimResult
) -> dict:
    """The coordinator loop: for each segment, choose its heads' qparams from every
    shard's statistics (and the lookup tables they complete), then let every shard run it
    with them."""
    result: dict[str, QParam] = {}
    n = sum(r.n for r in runners)
    bar = _progress(config, len(plan.segments) * n, "calibrating")
    try:
        for j, seg in enumerate(plan.segments):
            chosen = {}
            for sid in seg.heads:
                qp = result[sid] = choose_qparams(runners, sid, specs[sid])
                chosen[sid] = (qp.scale, qp.zero_point)
            tables = {
                layer: sim.table(layer, result)
                for layer, (_, out_sid, _) in sim.plan.tables.items()
                if out_sid in chosen
            }
            bar.set_postfix_str(",".join(seg.heads)[:40])
            for r in runners:
                r.run_segment(j, chosen, progress=lambda: bar.update(1), tables=tables)
    finally:
        bar.close()
    return result


def _pipeline(target):
    """The simulated graph's kernels with a cheap default schedule (vectorized, parallel;
    bit-identical results, see :mod:`autoq.loop_schedule`)."""
    if isinstance(target, dict | str):
        target = tvm.target.Target(target)
    return pipeline_with_loop_schedule(target)


def _calibrate_topological(sim, samples, weight_qp, config, target, stats) -> dict[str, QParam]:
    plan, functions = build_plan(sim)
    t0 = time.perf_counter()
    vm = compile_vm(functions, target, sim.mod, pipeline=_pipeline(target))
    stats["compile_s"] = time.perf_counter() - t0
    stats["segments"] = len(plan.segments)
    budget = config.memory_budget_mb * 2**20
    runner = ShardRunner(vm, plan, _static_values(sim, plan, weight_qp), budget, config.cache_dir)
    try:
        runner.load(samples)
        runner.run_prologue()
        result = run_plan(plan, [runner], sim.plan.specs, config, sim)
        stats.update(runner.stats, **runner.cache_stats())
    finally:
        runner.close()
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
    vm = compile_vm({"main": fn}, target, g.module, pipeline=_pipeline(target))
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
    if any(needs):  # a first pass: the exact ranges the histogram bins are fixed on
        first = [calibrators.range_observer(None) if nd else None for nd in needs]
        for outs in run(samples):
            for obs, x in zip(first, outs, strict=True):
                if obs is not None:
                    obs.update(x)
        ranges = [None if obs is None else obs.data_range() for obs in first]
    observers = [
        sp.calibrator.observer(axis=None, data_range=r) for sp, r in zip(specs, ranges, strict=True)
    ]
    for outs in run(samples):
        for obs, x in zip(observers, outs, strict=True):
            obs.update(x)
    return {s: obs.compute(sp) for s, obs, sp in zip(slots, observers, specs, strict=True)}
