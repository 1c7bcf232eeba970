"""Stage 2, calibrate: choose every slot's scale and zero point from data.

Weights are calibrated from the weight arrays themselves. Activations, in the default
``topological`` mode, are calibrated in topological order on values that already carry the
quantization error of every upstream choice, at the cost of **one** pass of the simulated
graph over the dataset:

1. the simulated ``main`` is cut into a prologue (everything that depends on weights only,
   computed once) and segments, one starting at each activation slot's quantize
   (:mod:`autoq.calibration.plan`);
2. all of them are compiled once, in one module (qparams are runtime inputs), each
   reduction kernel (conv, matmul, pooling) with a cheap vectorized, parallel schedule that
   gives the same bits (:mod:`autoq.ir.loop_schedule`);
3. a :class:`autoq.calibration.shard_runner.ShardRunner` holds the samples and runs the segments in
   order over all of them; the values still needed later are cached per sample
   (:class:`autoq.calibration.value_cache.ValueCache`: RAM up to ``memory_budget_mb``, then ``.npy``
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

import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Iterable

import numpy as np

from autoq import calibrators
from autoq.accuracy.weight_tuning import WeightTuner
from autoq.calibration import granularity
from autoq.calibration.holdout import split_holdout
from autoq.calibration.plan import CalibrationPlan, build_plan
from autoq.calibration.scale_health import HealthCheck, SlotHealth, problem
from autoq.calibration.shard_runner import ShardRunner, observe_ahead
from autoq.config import Config, QuantSpec, Resources
from autoq.config.progress import bar as progress_bar
from autoq.dataset import DatasetError, InputSpec, as_dataset, index_bounds
from autoq.errors import CalibratorError
from autoq.ir.registry import slot_id_of
from autoq.ir.run import calibration_pipeline, fp32_runner
from autoq.ir.target import default_target
from autoq.ir.toolkit import compile_vm, compile_vms, make_function
from autoq.qparams import QParam, QParams
from autoq.recipes import resolve
from autoq.rules import softmax_ranges
from autoq.rules.lut_ranges import bounded_lut_outputs, cut, lut_input_bounds
from autoq.rules.range_cuts import cut_ranges
from autoq.rules.residual_channels import widen
from autoq.simulation import SimResult
from autoq.threads import use_machine_cores

_log = logging.getLogger(__name__)

__all__ = [
    "FP32_SLOTS",
    "bias_holdout_count",
    "calibrate",
    "calibrate_weights",
    "calibration_functions",
    "calibration_vms",
    "choose_qparams",
    "cut_slots",
    "feed_observers",
    "fp32_observers",
    "fp32_slot_functions",
    "fp32_slot_runner",
    "make_qparams",
    "observe",
    "refuse_constant_inputs",
    "run_plan",
    "samples_for",
    "split_bias_holdout",
    "static_values",
    "warn_untuned",
]


# ------------------------------------------------------------------- dataset


def samples_for(dataset, inputs, cache: bool | str = "auto", module=None):
    """The validated, repeatable view of ``dataset`` for a model's input Vars
    (see :func:`autoq.dataset.as_dataset`: errors name the input and the sample). With the
    ``module`` (its ``main``), integer inputs indexing a table are range-checked too."""
    bounds = index_bounds(module["main"]) if module is not None else {}
    specs = [
        InputSpec(
            v.name, tuple(int(d) for d in v.ty.shape.values), str(v.ty.dtype), bounds.get(v.name)
        )
        for v in inputs
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
    qp = checked_result(obs.compute(spec), cal, "weight")
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
    _fit_zero_weights(sim, out)
    return out


def _fit_zero_weights(sim: SimResult, result: dict[str, QParam]) -> None:
    """All-zero weight channels (pruned filters, a zeroed layer) get the degenerate scale 1,
    which makes the bias step ``s_x * 1`` as coarse as the input's scale: give them
    ``|bias| / 2**15`` instead, so the channel's output (its bias) is kept to 16 bits."""
    for m in sim.matches:
        wsid = f"{m.layer}.weight"
        if "bias" not in m.nodes or wsid not in result:
            continue
        arr, axis = sim.plan.weights[wsid]
        qp = result[wsid]
        bias = np.abs(np.asarray(sim.graph.weight_of(m["bias"]).array, np.float64).reshape(-1))
        if axis is None or qp.scale.ndim == 0:
            zero, want = not np.any(arr), bias.max(initial=0.0) / 2**15
        else:
            zero = ~np.any(np.moveaxis(arr, axis, 0).reshape(arr.shape[axis], -1), axis=1)
            want = np.broadcast_to(bias, zero.shape) / 2**15
        fit = zero & (want >= np.finfo(np.float32).tiny)  # (a scale is a normal float32)
        if not np.any(fit):
            continue
        fitted = np.where(fit, want, qp.scale).astype(np.float32)
        result[wsid] = QParam(fitted, qp.zero_point, qp.dtype, qp.axis, qp.rmin, qp.rmax)


# ------------------------------------------------------------------- calibrate


def calibrate(
    sim: SimResult,
    params: dict | None,
    dataset,
    config: Config | None = None,
    target=None,
    fixed: dict[str, QParam] | None = None,
    resources: Resources | None = None,
) -> QParams:
    """Choose the qparams of every slot of ``sim`` (see the module docstring).

    ``params`` are the weight arrays (the same dict given to ``simulate``; may be None when
    the weights were constants); ``dataset`` an iterable of ``{input: array}`` dicts or of
    arrays (single-input models), validated before any work. ``fixed``: activation slot ->
    qparams taken as they are instead of calibrated (e.g. the int16 tensors an escalation
    chose: :mod:`autoq.fallback.escalation`); everything downstream is calibrated on their values.
    ``config``: the one ``sim`` was simulated with (None: the same); ``resources``: memory,
    cache folder and progress bars (:class:`autoq.config.Resources`).
    """
    config = sim.config if config is None else resolve(config, sim.graph)[0]
    resources = resources or Resources()
    use_machine_cores()
    target = target or default_target()
    g = sim.graph
    dataset, held = split_bias_holdout(dataset, config)
    samples = samples_for(dataset, g.inputs, module=g.module)
    held = samples_for(held, g.inputs, module=g.module) if held else None

    t0 = time.perf_counter()
    result = calibrate_weights(sim)
    stats: dict[str, float] = {"weights_s": time.perf_counter() - t0}
    health: dict[str, SlotHealth] = {}
    tuner = None
    if not sim.activation_slots():  # no layer left to quantize: nothing to run
        acts = dict(fixed or {})
    elif config.calibration == "fp32":
        acts = _calibrate_fp32(sim, samples, config, target, stats, health)
        acts.update(fixed or {})
        warn_untuned(config)
    else:
        acts, tuner = _calibrate_topological(
            sim, (samples, held), result, (config, resources), target, stats, health, fixed or {}
        )
    stats["total_s"] = time.perf_counter() - t0
    refuse_constant_inputs(sim, health, samples.num_samples)
    result.update(acts)
    return make_qparams(sim, result, config, samples.num_samples, stats, health, tuner)


def warn_untuned(config: Config) -> None:
    """Weight tuning asked for with ``calibration="fp32"``: say it does not apply."""
    if config.calibration == "fp32" and config.tunes_weights:
        warnings.warn(
            "Config.weight_rounding/bias_correction run inside topological "
            "calibration only; calibration='fp32' leaves the weights rounded to nearest",
            stacklevel=3,
        )


def make_qparams(
    sim: SimResult,
    result: dict[str, QParam],
    config: Config,
    samples: int | None,
    stats: dict,
    health: dict[str, SlotHealth] | None = None,
    tuner=None,
) -> QParams:
    """The :class:`QParams` of every slot from ``result`` (slot -> QParam, weights and
    activations), bias scales fitted (:func:`fit_bias_scales`), with the run's metadata
    (``health``: the scale health of the activation slots, when it was measured; ``tuner``:
    the weight tuner whose integer weights and summary go with them)."""
    widened = fit_bias_scales(sim, result)
    meta = {} if tuner is None else {"weight_tuning": tuner.summary()}
    return QParams(
        params={s: result[s] for s in sim.plan.slots},
        slots=dict(sim.plan.slots),
        meta={
            "calibration": config.calibration,
            "samples": samples,
            "specs": {s: sp.to_json() for s, sp in sim.plan.specs.items()},
            "bias_widened": widened,
            "scale_problems": scale_problems(health or {}, result, sim, config),
            "stats": {k: round(v, 4) for k, v in stats.items()},
            **meta,
        },
        values={} if tuner is None else tuner.values(result),
    )


def bias_holdout_count(config: Config) -> int:
    """How many samples ``BiasCorrection.holdout`` holds out: none in fp32 mode (the
    gate runs inside topological calibration)."""
    return config.bias_holdout if config.calibration != "fp32" else 0


def split_bias_holdout(dataset, config: Config) -> tuple:
    """(calibration samples, held-out samples) for ``BiasCorrection.holdout``: the
    last :func:`bias_holdout_count` samples."""
    return split_holdout(dataset, bias_holdout_count(config), "BiasCorrection.holdout")


def cut_slots(sim: SimResult, config: Config) -> set[str]:
    """The lookup-table input slots whose range ``Config.rules`` "lookup_input_ranges" cuts where the
    activation is flat (:mod:`autoq.rules.lut_ranges`): values beyond their grid are meant to be
    clipped (they give the same table entry); with "softmax_input_ranges", the masked softmax
    inputs cut below the scores (:mod:`autoq.rules.softmax_ranges`)."""
    out = set(lut_input_bounds(sim)) if config.has_rule("lookup_input_ranges") else set()
    if config.has_rule("softmax_input_ranges"):
        out |= set(softmax_ranges.softmax_input_slots(sim))
    return out


def scale_problems(health: dict, qparams: dict, sim: SimResult, config: Config) -> dict[str, str]:
    """slot -> why its chosen scale is unusable on its calibration values (see
    :mod:`autoq.calibration.scale_health`); healthy slots are left out. The ``cut`` slots
    (:func:`cut_slots`) are judged without their clipped values; the outputs of bounded
    lookups (:func:`autoq.rules.lut_ranges.bounded_lut_outputs`) whose grid lies inside the
    activation's output range, without the collapse count."""
    cut, bounded, out = cut_slots(sim, config), bounded_lut_outputs(sim), {}
    for sid, h in health.items():
        if sid in cut:
            h = dataclasses.replace(h, clipped=0)
        inside = sid in bounded and _grid_inside(qparams[sid], bounded[sid])
        why = problem(h, float(np.asarray(qparams[sid].scale).reshape(-1)[0]), inside)
        if why is not None:
            out[sid] = why
    return out


def _grid_inside(qp: QParam, interval: tuple[float, float]) -> bool:
    """Every channel's grid of ``qp`` lies inside ``interval`` (up to one step)."""
    lo, hi = (np.asarray(v, np.float64) for v in qp.grid_range())
    step = np.asarray(qp.scale, np.float64)
    return bool(np.all(lo >= interval[0] - step) and np.all(hi <= interval[1] + step))


def refuse_constant_inputs(sim: SimResult, health: dict, n) -> None:
    """A float model input that holds one value in every calibration sample is not
    calibration data (all-zero images, a placeholder array): every scale chosen from it
    would be a guess."""
    for sid, h in health.items():
        v = sim.plan.tensors.get(sid)
        if h.constant and any(v is not None and v.same_as(x) for x in sim.graph.inputs):
            raise DatasetError(
                f"calibration input {v.name!r} holds the same value ({h.lo:g}) everywhere "
                f"in all {n} sample(s): scales chosen from it would be guesses and real inputs "
                "would be clipped; calibrate on real, representative data"
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
        if xq is None or m.layer in sim.plan.dynamic:  # (no input slot: run-time scales)
            continue
        wq = result[wsid]
        bias = np.abs(np.asarray(sim.graph.weight_of(m["bias"]).array, np.float64).reshape(-1))
        s_x = np.asarray(xq.scale, np.float64).reshape(-1)  # (per channel: depthwise)
        need = (bias / (s_x * BIAS_LIMIT)).astype(np.float32)
        if np.all(need <= wq.scale):
            continue
        # per-tensor weights: one scale that fits every channel's bias
        new = np.maximum(wq.scale, need if wq.scale.ndim else need.max()).astype(np.float32)
        result[wsid] = QParam(new, wq.zero_point, wq.dtype, wq.axis, wq.rmin, wq.rmax)
        changed.append(m.layer)
    return changed


def static_values(sim: SimResult, plan: CalibrationPlan, weight_qp: dict) -> dict:
    """key -> array: the weights and the weight qparams (inputs of the prologue)."""
    g = sim.graph
    static = {k: g.params[name] for k, name in plan.weight_keys.items()}
    for sid, qp in weight_qp.items():
        s_key, z_key = plan.qparam_keys[sid]
        static[s_key], static[z_key] = qp.scale, qp.zero_point
    static.update({k: sim.value_input(name) for name, k in plan.value_keys.items()})
    return static


def _merged(observers: list):
    """One observer holding the exact merge of the shards' observers."""
    first = observers[0]
    for o in observers[1:]:
        first.merge(o)
    return first


def choose_qparams(runners: list, slot: str, spec: QuantSpec, observers=None) -> QParam:
    """``slot``'s qparams from the merged statistics of every shard (a range pass first
    for histogram calibrators): the only place activation qparams are chosen.
    ``observers``: the shards' observers of the slot filled already
    (:func:`autoq.calibration.shard_runner.observe_ahead`)."""
    cal = spec.calibrator
    data_range = None
    if getattr(cal, "needs_range", False):
        data_range = _merged([r.range_observer(slot) for r in runners]).data_range()
    if observers is None:
        observers = [r.observer(slot, cal, data_range) for r in runners]
    return checked_result(_merged(observers).compute(spec), cal, slot)


def choose_depthwise(runner, slot: str, spec: QuantSpec, weight, ahead: dict) -> QParam:
    """A depthwise input's qparams (:mod:`autoq.calibration.granularity`): each channel on
    its own grid when that leaves less error on held-out samples and it was calibrated on
    a range (:func:`autoq.calibration.granularity.ranged`), else on the shared per-tensor
    grid."""
    feed = functools.partial(runner.feed, slot)
    err = granularity.held_out_errors(runner.n, spec, weight, feed)
    own = granularity.own_grids(err["per_channel"], err["per_tensor"])
    per_channel = choose_qparams([runner], slot, spec, ahead.pop(slot, None)) if own.any() else None
    if per_channel is not None:
        own &= granularity.ranged(per_channel)
    _log.debug(
        "depthwise input %s: own grid on %d of %d channels, held-out error %.4g -> %.4g",
        slot,
        own.sum(),
        own.size,
        err["per_tensor"].sum(),
        np.where(own, err["per_channel"], err["per_tensor"]).sum(),
    )
    if own.all():
        return per_channel
    qp = checked_result(granularity.fit(feed, spec, None), spec.calibrator, slot)
    return granularity.shared_grid(qp, own.size, per_channel, own)


def checked_result(qp, calibrator, slot: str) -> QParam:
    """The calibrator contract's last clause: ``observer.compute(spec)`` returns a QParam."""
    if not isinstance(qp, QParam):
        raise CalibratorError(
            f"calibrator contract: observer.compute(spec) must return an autoq.QParam; "
            f"calibrator {getattr(calibrator, 'name', calibrator)!r} returned "
            f"{type(qp).__name__} for slot {slot!r}"
        )
    return qp


def run_plan(
    plan: CalibrationPlan,
    runners: list,
    specs: dict,
    config: Config,
    sim: SimResult,
    health: dict | None = None,
    tuner=None,
    fixed: dict[str, QParam] | None = None,
    held: list = (),
    resources: Resources | None = None,
) -> dict:
    """The coordinator loop: for each segment, choose its heads' qparams from every
    shard's statistics (and the lookup tables they complete), let ``tuner`` (a
    :class:`autoq.accuracy.weight_tuning.WeightTuner`) tune the layers reading them, then let every
    shard run it with them. ``health`` (a dict) receives each head's :class:`SlotHealth`
    for its chosen qparams on the same values. ``fixed``: slot -> qparams used as they are.
    ``held``: runners of held-out samples that run every segment but give no statistics
    (``BiasCorrection.holdout``: only the tuner's gate reads them). Lookup inputs:
    cut where flat (``Config.rules`` "lookup_input_ranges"); last-axis channels: widened (``widen``)."""
    result: dict[str, QParam] = {}
    n = sum(r.n for r in runners)
    bounds = lut_input_bounds(sim) if config.has_rule("lookup_input_ranges") else {}
    on = config.has_rule("softmax_input_ranges")
    softmax_inputs = softmax_ranges.softmax_input_slots(sim) if on else {}
    depthwise = granularity.depthwise_slots(sim)
    if depthwise and len(runners) > 1:
        warnings.warn(
            f"distributed calibration keeps all {len(depthwise)} ReLU6-written depthwise inputs "
            "per channel: their held-out per-tensor / per-channel choice "
            "(autoq.calibration.granularity) runs in local calibration only, so this model "
            "differs from a local quantization of the same data; quantize without cluster= "
            "for the recipe's choice",
            stacklevel=2,
        )
        depthwise = {}
    show = (resources or Resources()).show_progress
    bar = progress_bar(total=len(plan.segments) * n, desc="calibrating", show=show)
    pending: dict[str, list] = {}  # the previous segment's health observers, still filling
    ahead: dict[str, list] = {}  # this segment's heads' observers, filled as values came
    try:
        for j, seg in enumerate(plan.segments):
            chosen = {}
            for sid in seg.heads:
                qp = (fixed or {}).get(sid)
                if qp is None and sid in depthwise:
                    qp = choose_depthwise(runners[0], sid, specs[sid], depthwise[sid], ahead)
                if qp is None:
                    qp = widen(choose_qparams(runners, sid, specs[sid], ahead.get(sid)), sim, sid)
                    if sid in bounds:  # autoq.rules.lut_ranges
                        qp = cut(qp, bounds[sid], specs[sid])
                    if sid in softmax_inputs:  # autoq.rules.softmax_ranges
                        a, b = softmax_inputs[sid]
                        qp = softmax_ranges.cut(qp, result[a], result[b], specs[sid])
                result[sid] = qp
                chosen[sid] = (qp.scale, qp.zero_point)
            _finish_health(pending, health, specs)
            if health is not None:  # computed while the segment is tuned and run
                check = {sid: HealthCheck(result[sid]) for sid in seg.heads}
                pending = {s: [r.observe_later(s, check[s]) for r in runners] for s in seg.heads}
            tables = {
                layer: sim.table(layer, result)
                for layer, (_, out_sid, _) in sim.plan.tables.items()
                if out_sid in chosen
            }
            if tuner is not None:
                tuner.step(seg.heads, result, runners, held)
            bar.set_postfix_str(",".join(seg.heads)[:40])
            nxt = plan.segments[j + 1].heads if j + 1 < len(plan.segments) else ()
            ahead = observe_ahead(runners, nxt, specs, fixed or {})
            for r in runners:
                r.run_segment(j, chosen, progress=lambda: bar.update(1), tables=tables)
            for r in held:
                r.run_segment(j, chosen, tables=tables)
        _finish_health(pending, health, specs)
    finally:
        bar.close()
    return result


def _finish_health(pending: dict[str, list], health: dict | None, specs: dict) -> None:
    """Merge and compute the health observers of ``pending`` (slot -> its shards'
    observers, emptied) into ``health``."""
    for sid, observers in pending.items():
        health[sid] = _merged(observers).compute(specs[sid])
    pending.clear()


def _calibrate_topological(
    sim, samples, weight_qp, settings, target, stats, health, fixed
) -> dict[str, QParam]:
    """``samples``: (calibration samples, held-out samples or None); ``settings``:
    (config, resources)."""
    (samples, held), (config, resources) = samples, settings
    plan, functions = calibration_functions(sim)
    t0 = time.perf_counter()
    vm, twin = calibration_vms(sim, functions, target, 2)
    stats["compile_s"] = time.perf_counter() - t0
    stats["segments"] = len(plan.segments)
    budget = resources.memory_budget_mb * 2**20
    tuner = WeightTuner(sim, config, weight_qp, plan) if config.tunes_weights else None
    static = static_values(sim, plan, weight_qp)

    runners = [
        ShardRunner(vm, plan, static, budget, resources.cache_dir, twin)
        for _ in range(1 if held is None else 2)
    ]
    if tuner is not None and tuner.fp32_slots():  # empirical bias correction's fp32 means
        t0 = time.perf_counter()
        outs = _fp32_slots_runner(sim, vm, tuner.fp32_slots())
        tuner.observe_fp32(outs(samples), () if held is None else outs(held))
        stats["fp32_means_s"] = time.perf_counter() - t0
    try:
        for r, part in zip(runners, (samples, held), strict=False):
            r.load(part)
            r.run_prologue()
        result = run_plan(
            plan, runners[:1], sim.plan.specs, config, sim, health, tuner, fixed, runners[1:],
            resources,
        )  # fmt: skip
        stats.update(runners[0].stats, **runners[0].cache_stats())
        if held is not None:
            stats["held_out_samples"] = held.num_samples
    finally:
        for r in runners:
            r.close()
    missing = [s for s in sim.activation_slots() if s not in result]
    if missing:
        raise RuntimeError(f"internal error: activation slots {missing} were never calibrated")
    return result, tuner


def fp32_slot_functions(sim: SimResult, slots: list[str], tensors=()) -> dict:
    """``{"main": f}``: the float graph ``f(*inputs, *weights)`` returning the tensors that
    the activation ``slots`` quantize, then ``tensors`` (Vars of ``sim.graph``)."""
    g, tensors = sim.graph, [*(sim.plan.tensors[s] for s in slots), *tensors]
    return {"main": make_function("main", [*g.inputs, *g.weight_params], g.bindings, tensors)}


def fp32_slot_runner(sim: SimResult, slots: list[str], target, shared: bool = False):
    """``run(samples)``: for each sample, the fp32 values of the tensors that the
    activation ``slots`` quantize (one compiled float graph with those tensors as outputs;
    ``shared``: the ``fp32_slots`` function of the topological calibration module,
    :func:`calibration_functions`, which calibration then finds in the compile cache)."""
    if not shared:
        return fp32_tensor_runner(sim, [sim.plan.tensors[s] for s in slots], target)
    _, functions = calibration_functions(sim)
    return _fp32_slots_runner(sim, calibration_vms(sim, functions, target)[0], slots)


def _fp32_slots_runner(sim: SimResult, vm, slots: list[str]):
    """``run(samples)`` of the ``fp32_slots`` function of a compiled calibration module:
    the values of ``slots`` (of :meth:`SimResult.activation_slots`)."""
    g, index = sim.graph, {s: i for i, s in enumerate(sim.activation_slots())}
    weights = [g.params[p.name] for p in g.weight_params]
    pick = [index[s] for s in slots]
    return fp32_runner(vm, [v.name for v in g.inputs], weights, FP32_SLOTS, pick)


#: the float graph in the calibration module (:func:`calibration_functions`)
FP32_SLOTS = "fp32_slots"


def calibration_functions(sim: SimResult) -> tuple[CalibrationPlan, dict]:
    """The plan of ``sim``'s topological calibration and its module's functions: the
    prologue, the segments and :data:`FP32_SLOTS`, the float graph
    ``fp32_slots(*inputs, *weights)`` returning every activation slot's tensor (in
    :meth:`SimResult.activation_slots` order). The guard, the bias correction's fp32 means
    and calibration all run this one module: compiled once, then a compile-cache hit
    (:mod:`autoq.ir.compile_cache`); legalization gives the float graph's ops the kernels
    of the simulated graph's identical ones, so it adds few. Built once per ``sim`` (kept in
    ``sim.derived``: the guard and calibration share it)."""
    if FP32_SLOTS not in sim.derived:
        plan, functions = build_plan(sim)
        g = sim.graph
        tensors = [sim.plan.tensors[s] for s in sim.activation_slots()]
        inputs = [*g.inputs, *g.weight_params]
        functions[FP32_SLOTS] = make_function(FP32_SLOTS, inputs, g.bindings, tensors)
        sim.derived[FP32_SLOTS] = plan, functions
    plan, functions = sim.derived[FP32_SLOTS]
    return plan, dict(functions)


def calibration_vms(sim: SimResult, functions: dict, target, count: int = 1) -> list:
    """``count`` VMs over the compiled calibration module (:func:`calibration_functions`)."""
    return compile_vms(functions, target, sim.mod, calibration_pipeline(target), count)


def fp32_tensor_runner(sim: SimResult, tensors: list, target):
    """``run(samples)``: for each sample, the fp32 values of ``tensors`` (Vars of
    ``sim.graph``), from one compiled float graph with them as outputs."""
    g, funcs = sim.graph, fp32_slot_functions(sim, [], tensors)
    vm = compile_vm(funcs, target, g.module, pipeline=calibration_pipeline(target))
    weights = [g.params[p.name] for p in g.weight_params]
    return fp32_runner(vm, [v.name for v in g.inputs], weights)


def fp32_observers(specs: list[QuantSpec], ranges: list | None, axes=None) -> list:
    """The observers of one fp32-mode pass, one per slot (channel ``axes``, None: per tensor):
    with ``ranges`` None the range pass (a range observer for each histogram calibrator, None
    for the others), else each slot's calibrator observer with its data range."""
    pairs = zip(specs, axes or [None] * len(specs), strict=True)
    if ranges is None:
        needs = [(getattr(sp.calibrator, "needs_range", False), a) for sp, a in pairs]
        return [calibrators.range_observer(a) if nd else None for nd, a in needs]
    pairs = zip(pairs, ranges, strict=True)
    return [sp.calibrator.observer(axis=a, data_range=r) for (sp, a), r in pairs]


def feed_observers(observers: list, outputs: Iterable[list]) -> list:
    """Update each observer (None: skipped) with its tensor of every sample's ``outputs``
    (empty tensors skipped)."""
    for outs in outputs:
        for obs, x in zip(observers, outs, strict=True):
            if obs is not None and np.size(x):
                obs.update(x)
    return observers


def _calibrate_fp32(sim, samples, config, target, stats, health) -> dict[str, QParam]:
    slots = sim.activation_slots()
    t0 = time.perf_counter()
    run = fp32_slot_runner(sim, slots, target)

    stats["compile_s"] = time.perf_counter() - t0
    specs = [sim.plan.specs[s] for s in slots]
    ranges: list = [None] * len(slots)
    axes = [sim.plan.slots[s].axis for s in slots]
    first = fp32_observers(specs, None, axes)
    if any(o is not None for o in first):  # the exact ranges the histogram bins are fixed on
        feed_observers(first, run(samples))
        ranges = [None if obs is None else obs.data_range() for obs in first]
    observers = feed_observers(fp32_observers(specs, ranges, axes), run(samples))
    result = {
        s: widen(checked_result(obs.compute(sp), sp.calibrator, s), sim, s)
        for s, obs, sp in zip(slots, observers, specs, strict=True)
    }
    cut_ranges(sim, result, config)
    # the chosen scales against the values they represent
    checks = feed_observers([HealthCheck(result[s]).observer() for s in slots], run(samples))
    health.update({s: obs.compute() for s, obs in zip(slots, checks, strict=True)})
    return result
