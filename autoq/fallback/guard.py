"""Slots that cannot be quantized at all: unbounded activations.

Transformer exports often write attention masks as ``scores + (1 - mask) * finfo.min``: the
mask tensor (and the sum) hold -3.4e38. Any int8 grid spanning that range rounds every real
score to one value, and the model's output is garbage (ONNX Runtime's defaults do exactly
that on all-MiniLM-L6-v2: output cosine 0.34). Such a slot is not a calibration problem but
a layer that must stay fp32. :func:`unbounded_slots` finds them with a short fp32 run before
calibration; :func:`layers_using` names the layers to keep in fp32; ``autoq.quantize`` does
both when ``Config.skip_unbounded`` is on (the default) and says which layers it kept.
Masks the graph builds from a ``finfo.min`` constant never get here: canonicalization
rewrites that constant to a quantizable one (:mod:`autoq.ir.attention_mask`); the guard still
catches sentinels that arrive as model inputs (a precomputed additive mask) or NaN/inf.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings

import numpy as np
from tvm import relax

from autoq.calibration import fp32_slot_runner, samples_for
from autoq.config import Config
from autoq.config.progress import bar
from autoq.ir.registry import slot_id_of
from autoq.simulation import SimResult

__all__ = ["UNBOUNDED", "keep_unbounded_in_fp32", "layers_using", "unbounded_slots"]

#: |value| at or above this (or inf/nan) is a sentinel, not data
UNBOUNDED = 1e30


def unbounded_slots(
    sim: SimResult,
    dataset,
    target=None,
    samples: int = 2,
    stats: dict | None = None,
    shared: bool = False,
) -> dict[str, tuple[float, float]]:
    """Activation slots whose fp32 values reach ``UNBOUNDED`` on the first ``samples``
    samples, with their observed range. ``stats`` (a dict) receives ``compile_s``, the
    one-off compile of the fp32 graph the check runs. ``shared``: run the float graph of
    the calibration module (:func:`autoq.calibration.calibration_functions`: topological
    calibration of ``sim`` then compiles nothing again)."""
    from autoq.ir.target import default_target

    slots = sim.activation_slots()
    if not slots:
        return {}
    t0 = time.perf_counter()
    run = fp32_slot_runner(sim, slots, target or default_target(), shared)
    if stats is not None:
        stats["compile_s"] = time.perf_counter() - t0
    data = list(itertools.islice(samples_for(dataset, sim.graph.inputs), samples))
    lo = {s: np.inf for s in slots}
    hi = {s: -np.inf for s in slots}
    for outs in bar(run(data), total=len(data), desc="guard", unit="sample"):
        for s, x in zip(slots, outs, strict=True):
            if x.size:
                # np.minimum/np.maximum propagate NaN (Python's min/max would drop it)
                lo[s] = float(np.minimum(lo[s], np.min(x)))
                hi[s] = float(np.maximum(hi[s], np.max(x)))
    return {
        s: (lo[s], hi[s])
        for s in slots
        if not (np.isfinite(lo[s]) and np.isfinite(hi[s]))
        or max(abs(lo[s]), abs(hi[s])) >= UNBOUNDED
    }


def layers_using(sim: SimResult, slots) -> list[str]:
    """Layers (in topological order) that read one of ``slots`` or produce it."""
    slots = set(slots)
    tensor_id = slot_id_of(sim.graph, sim.matches)
    out = []
    for m in sim.matches:
        touched = {m.layer} if m.layer in sim.plan.slots else set()
        for v in m.nodes.values():
            if isinstance(v, relax.Var) and v in sim.graph.ids and not v.same_as(m.root):
                touched.add(tensor_id(v))
        if touched & slots:
            out.append(m.layer)
    return out


def keep_unbounded_in_fp32(
    sim: SimResult,
    dataset,
    config: Config,
    target=None,
    stats: dict | None = None,
    shared: bool = False,
) -> tuple[Config, list[str]]:
    """``config`` with the layers reading or writing unbounded activations of ``sim`` added
    to its fallback ids (with a warning naming them and their ranges), and those layers.
    ``stats``, ``shared``: see :func:`unbounded_slots`."""
    bad = unbounded_slots(sim, dataset, target, stats=stats, shared=shared)
    layers = [x for x in layers_using(sim, bad) if x not in config.fallback.ids]
    if not layers:
        return config, []
    ranges = ", ".join(f"{s} [{lo:.3g}, {hi:.3g}]" for s, (lo, hi) in bad.items())
    warnings.warn(
        f"keeping {len(layers)} layer(s) in fp32 because their activations are unbounded "
        f"(masking constants?): {', '.join(layers)}; ranges: {ranges}. "
        "Set Config(skip_unbounded=False) to quantize them anyway.",
        stacklevel=3,
    )
    fb = dataclasses.replace(config.fallback, ids=(*config.fallback.ids, *layers))
    return config.replace(fallback=fb), layers
