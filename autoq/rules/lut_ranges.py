"""Lookup-table inputs need no range where the activation is flat.

A slot read only by table-lookup layers (:mod:`autoq.ir.activations`; the patterns of
``patterns/activation.py`` and ``patterns/activation_affine.py``) is worth representing only
where its readers' activation still changes: hardswish is exactly 0 below -3, hardsigmoid
exactly 0 below -3 and 1 above 3, sigmoid is within 5e-8 of 0 or 1 beyond +-17, tanh within
3e-8 of -1 or 1 beyond +-9, silu and gelu within 5e-8 of 0 below -20 and -6. Values beyond
those points give the same table entry as the point itself (up to those 5e-8), so the
calibrated range is cut there: the same outputs, on a finer input grid. The calibrator saw
the whole range (a symmetric conv output feeding a hardswish spans ``[-80, 76]`` in
PP-OCRv4 det: cut at -3, its step halves), and a logit read by a sigmoid spans
``[-146, 104]`` there (step 0.98 logit at the 0.3 decision threshold; cut at +-17, 0.13).

A slot is cut only when every use of its tensor is inside such a lookup layer (no float
op, residual add or model output reads it) and both the slot and the layer's output are
8-bit (the table form; a 16-bit layer computes the activation in float). The cut range is
re-quantized with the slot's spec (:func:`autoq.qparams.QParam.from_range`; it still holds
0). ``Config.rules`` "lookup_input_ranges" (default False: it helped PP-OCRv4 det by 0.1 point and cost
all-MiniLM-L6-v2 3 NN@1 points, README) turns it on.

    >>> flat_interval("hardswish"), flat_interval("hardsigmoid_affine")
    ((-3.0, None), (-3.0, 3.0))
"""

from __future__ import annotations

import numpy as np

from autoq.ir.activations import LUT_DTYPES, Activation
from autoq.qparams import QParam
from autoq.rules import lut_channels

__all__ = [
    "BOUNDED",
    "FLAT",
    "bounded_lut_outputs",
    "cut",
    "cut_lut_inputs",
    "flat_interval",
    "lut_input_bounds",
]

#: activation -> (below this the output is constant, above this it is constant); None: no
#: such point (within 5e-8 of the limit, see the module docstring)
FLAT: dict[str, tuple[float | None, float | None]] = {
    "hardswish": (-3.0, None),
    "hardsigmoid": (-3.0, 3.0),
    "sigmoid": (-17.0, 17.0),
    "tanh": (-9.0, 9.0),
    "silu": (-20.0, None),
    "gelu": (-6.0, None),
    "gelu_tanh": (-6.0, None),
}


#: activation -> the interval its output lies in, for the bounded ones (a plain row only: an
#: affine row ``f(x) * a + b`` has its own)
BOUNDED: dict[str, tuple[float, float]] = {
    "sigmoid": (0.0, 1.0),
    "hardsigmoid": (0.0, 1.0),
    "tanh": (-1.0, 1.0),
}


def flat_interval(activation) -> tuple[float | None, float | None]:
    """The live interval of a lookup layer's activation (a row name, e.g. ``"sigmoid"`` or
    ``"hardswish_affine"``, or an :class:`autoq.ir.activations.Activation` row): an affine
    row ``f(x) * a + b`` is flat where ``f`` is."""
    name = activation.name if isinstance(activation, Activation) else str(activation)
    return FLAT.get(name.removesuffix("_affine"), (None, None))


def lut_input_bounds(sim) -> dict[str, tuple[float | None, float | None]]:
    """slot -> the interval its range may be cut to, for every 8-bit slot whose tensor is
    used only inside 8-bit lookup layers (see the module docstring)."""
    g, specs = sim.graph, sim.plan.specs
    readers: dict[str, list] = {}
    for m in sim.matches:
        if m.layer not in sim.plan.tables:
            continue
        in_sid, out_sid, act = sim.plan.tables[m.layer]
        if specs[in_sid].dtype in LUT_DTYPES and specs[out_sid].dtype in LUT_DTYPES:
            readers.setdefault(in_sid, []).append((m, flat_interval(act)))
    outputs = set(g.output_vars())
    out = {}
    for sid, ms in readers.items():
        var = sim.plan.tensors.get(sid)
        inside = {v for m, _ in ms for v in m.covered}
        users = g.users.get(var, [])
        if var is None or var in outputs or not users or any(u not in inside for u in users):
            continue
        los = [lo for _, (lo, _) in ms]
        his = [hi for _, (_, hi) in ms]
        lo = None if any(v is None for v in los) else min(los)
        hi = None if any(v is None for v in his) else max(his)
        if lo is not None or hi is not None:
            out[sid] = (lo, hi)
    return out


def bounded_lut_outputs(sim) -> dict[str, tuple[float, float]]:
    """slot -> the output interval of its activation (:data:`BOUNDED`), for every 8-bit
    output slot of an 8-bit lookup layer whose activation is bounded: a class-score or
    probability sigmoid, whose grid can never be wider than ``[0, 1]`` (scale health judges
    these without the collapse count: :mod:`autoq.calibration.scale_health`)."""
    out = {}
    for _, out_sid, act in sim.plan.tables.values():  # a table: both slots are 8-bit
        name = act.name if isinstance(act, Activation) else str(act)
        if name in BOUNDED:
            out[out_sid] = BOUNDED[name]
    return out


def cut(qp: QParam, bounds: tuple[float | None, float | None], spec) -> QParam:
    """``qp`` (per tensor) with its range cut to ``bounds`` (unchanged when it lies inside);
    the range keeps 0, as every activation range does. Per channel: each channel's range
    (:func:`autoq.rules.lut_channels.cut`)."""
    if qp.per_axis:
        return lut_channels.cut(qp, bounds, spec)
    rmin, rmax = (float(np.reshape(v, -1)[0]) for v in qp.grid_range())
    lo, hi = bounds
    new_min = rmin if lo is None else max(rmin, min(lo, 0.0))
    new_max = rmax if hi is None else min(rmax, max(hi, 0.0))
    if new_min == rmin and new_max == rmax:
        return qp
    return QParam.from_range(
        np.float64(new_min), np.float64(new_max), spec.dtype, spec.symmetric,
        spec.narrow_range, spec.reduce_range,
    )  # fmt: skip


def cut_lut_inputs(sim, result: dict, config, fixed=()) -> None:
    """Cut, in place, the qparams in ``result`` (slot -> QParam) of every lookup-table input
    slot (:func:`lut_input_bounds`) when ``config.has_rule("lookup_input_ranges")`` is on; ``fixed`` slots
    are kept as given."""
    if not config.has_rule("lookup_input_ranges"):
        return
    for sid, b in lut_input_bounds(sim).items():
        if sid in result and sid not in fixed:
            result[sid] = cut(result[sid], b, sim.plan.specs[sid])
