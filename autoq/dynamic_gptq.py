"""GPTQ for the hybrid's dynamic layers (:mod:`autoq.hybrid`, ``Config.dynamic_gptq``).

A dynamic layer quantizes its input at run time and has no activation slot, so the weight
tuner of topological calibration (:mod:`autoq.weight_tuning`), which streams a slot's
quantized values into the Hessians of the layers reading it, never sees its input: its
weights round to nearest. Here the float graph runs once over the calibration samples with
the dynamic layers' inputs as its outputs (:func:`dynamic_inputs`); each distinct input
(MiniLM's q, k and v dense layers share one) gets ``H = 2 X^T X / n`` over its rows
(tokens), and each layer's weight is rounded by GPTQ (:func:`autoq.gptq.gptq`) on it with
the layer's calibrated per-channel weight scales, or to nearest when there are fewer than
:data:`autoq.weight_tuning.MIN_ROWS_PER_COLUMN` rows per weight column (as for the static
layers). With ``Config.token_mask`` the rows are the real tokens only (padding positions,
which the model never uses, stay out of the Hessian as out of every calibration statistic).

The Hessian is the fp32 input's, not that of the run-time quantized one: a dynamic layer's
integers differ from its float input by one per-token rounding (1/255 of each row's range),
and the fp32 input carries none of the upstream static layers' rounding (GPTQ's objective
``||X W^T - X W_q^T||`` on the float model's inputs; Frantar et al. 2022 feed the partly
quantized model's inputs instead, which here would need the calibration plan to expose a
tensor that no slot quantizes).

The tuned weights (dequantized, in the graph's layout) are fixed before topological
calibration starts, so every static slot downstream is calibrated on them, and they go to
``QParams.values`` like the static layers' tuned weights (the simulated graph reads them,
realize takes their integers).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from .gptq import gptq, rtn
from .hessian import Hessian
from .qparams import QParam
from .simulate import SimResult
from .token_mask import masked_outputs, token_layouts
from .toolkit import shape_of
from .weight_tuning import MIN_ROWS_PER_COLUMN

__all__ = ["dynamic_inputs", "tune", "tune_dynamic_weights"]


def _dense_layers(sim: SimResult) -> list:
    """The dynamic matches whose weight is a 2-D ``(in, out)`` dense weight."""
    out = []
    for m in sim.matches:
        sid = f"{m.layer}.weight"
        if m.layer in sim.plan.dynamic and sid in sim.plan.weights:
            if sim.plan.weights[sid][0].ndim == 2:
                out.append(m)
    return out


def dynamic_inputs(sim: SimResult) -> list:
    """The distinct float tensors (Vars of ``sim.graph``) the dynamic dense layers read, in
    graph order: what :func:`tune_dynamic_weights` needs one value of per sample."""
    seen: list = []
    for m in _dense_layers(sim):
        if not any(m["data"].same_as(v) for v in seen):
            seen.append(m["data"])
    return seen


def tune_dynamic_weights(
    sim: SimResult, weight_qp: dict[str, QParam], values: Iterable[list[np.ndarray]]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """``({<layer>.weight: tuned float weight}, stats)`` for the dynamic dense layers of
    ``sim``: ``values`` yields, per calibration sample, the fp32 values of
    :func:`dynamic_inputs` in that order; ``weight_qp``: the calibrated weight qparams.
    ``stats``: how many layers GPTQ rounded (``dynamic_gptq``) and how many it left to
    nearest (``dynamic_nearest``, too few rows)."""
    tensors = dynamic_inputs(sim)
    layers = _dense_layers(sim)
    hessians = [Hessian.dense(int(np.shape(sim.plan.weights[f"{m.layer}.weight"][0])[0]))
                for m in _first_reader(layers, tensors)]  # fmt: skip
    for per_sample in values:
        for h, x in zip(hessians, per_sample, strict=True):
            h.update(x)
    stats = {"dynamic_gptq": 0, "dynamic_nearest": 0}
    out = {}
    for m in layers:
        sid = f"{m.layer}.weight"
        h = hessians[_index(tensors, m["data"])]
        out[sid], rounded = _round(sim, sid, weight_qp[sid], h)
        stats["dynamic_gptq" if rounded else "dynamic_nearest"] += 1
    return out, stats


def tune(sim: SimResult, samples, weight_qp, tuner, stats: dict, runner, target) -> dict:
    """``Config.dynamic_gptq`` inside topological calibration: the dynamic layers' GPTQ
    weights (``<layer>.weight`` -> float array, ``{}`` when off or without dynamic layers)
    from one fp32 pass (``runner(sim, tensors, target)(samples)``: per sample the fp32
    values of ``tensors``, :func:`autoq.calibrate.fp32_tensor_runner`), handed to ``tuner``
    (:class:`autoq.weight_tuning.WeightTuner`: its values realize them); counts and seconds
    go to ``stats``."""
    if tuner is None or not tuner.config.dynamic_gptq or not sim.plan.dynamic:
        return {}
    t0 = time.perf_counter()
    tensors, mask = dynamic_inputs(sim), tuner.config.token_mask
    run = runner(sim, tensors, target)
    # Config.token_mask: the Hessians over real tokens only, as every calibration statistic
    shapes = token_layouts(mask, sim.graph.inputs, dict(enumerate(map(shape_of, tensors))))
    values = masked_outputs(
        run(samples), samples, mask, [shapes.get(i) for i in range(len(tensors))]
    )
    tuned, counts = tune_dynamic_weights(sim, weight_qp, values)
    tuner.weights.update(tuned)
    stats.update(counts, dynamic_gptq_s=time.perf_counter() - t0)
    return tuned


def _first_reader(layers: list, tensors: list) -> list:
    """For each tensor, the first layer reading it (its width sizes the Hessian)."""
    return [next(m for m in layers if m["data"].same_as(t)) for t in tensors]


def _index(tensors: list, var) -> int:
    return next(i for i, t in enumerate(tensors) if t.same_as(var))


def _round(sim: SimResult, sid: str, qp: QParam, h: Hessian) -> tuple[np.ndarray, bool]:
    """Layer ``sid``'s weight rounded by GPTQ on ``h`` (or to nearest with too few rows),
    dequantized in the graph's ``(in, out)`` layout; and whether GPTQ rounded it."""
    w = sim.plan.weights[sid][0].astype(np.float64).T  # (out, in)
    o, k = w.shape
    qmin, qmax = sim.plan.specs[sid].qrange
    scale = np.broadcast_to(np.asarray(qp.scale, np.float64), (o,))
    zp = np.broadcast_to(np.asarray(qp.zero_point, np.float64), (o,))
    rounded = h.rows >= MIN_ROWS_PER_COLUMN * k
    q = (
        gptq(w, h.matrix()[0], scale, zp, qmin, qmax).q
        if rounded
        else rtn(w, scale, zp, qmin, qmax)
    )
    wq = (q - zp[:, None]).astype(np.float32) * np.asarray(scale, np.float32)[:, None]
    return np.ascontiguousarray(wq.T), rounded
