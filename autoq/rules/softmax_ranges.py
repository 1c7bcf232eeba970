"""Softmax inputs need no range far below the scores (``Config.rules`` "softmax_input_ranges").

An attention block adds its mask to the scores before the softmax: ``softmax(s + m)`` with
``m`` 0 for the keys a query sees and very negative for the others (-100 after
:mod:`autoq.ir.attention_mask`). The sum is an 8-bit ``add`` layer whose grid must span
both, so its low end is the scores' minimum plus the mask: all-MiniLM-L6-v2's first layer
has scores in about ``[-96, 50]`` and the sum's grid ``[-196, 45]``, a step of 0.94 logit
spent on values the softmax turns into ``exp(-100)``.

The softmax subtracts each row's maximum, and every row holds a key the query sees
(``m = 0``), so the row maximum is at least the scores' minimum ``lo``. A value below
``lo - SPAN`` weighs less than ``exp(-SPAN)`` of that maximum; clipping it to ``lo - SPAN``
can only raise it to that weight. With :data:`SPAN` 16, 127 clipped keys add at most
``127 * exp(-16) = 1.4e-5`` to a row's probabilities, 1/280 of the 8-bit softmax output's
step (1/255); the values the softmax reads with weight get the finer step.

A slot is cut when it is the 8-bit output of an ``add`` layer of two activations whose every
reader is a softmax over the last axis, and one operand's calibrated grid ends at or below
0 (the mask: it only lowers the scores); the bound is the other operand's grid minimum
minus :data:`SPAN`. Both operands are calibrated before the sum (topological order), so the
cut reads their chosen qparams.

    >>> from autoq.config import QuantSpec
    >>> spec = QuantSpec(dtype="int8", symmetric=False)
    >>> scores = QParam.from_range(np.float64(-96.0), np.float64(50.0))
    >>> mask = QParam.from_range(np.float64(-100.0), np.float64(0.0))
    >>> total = QParam.from_range(np.float64(-196.0), np.float64(45.0))
    >>> [round(float(v), 1) for v in cut(total, scores, mask, spec).grid_range()]  # zero point rounded
    [-112.4, 45.1]
"""

from __future__ import annotations

import numpy as np

from autoq.ir.activations import LUT_DTYPES
from autoq.ir.toolkit import op_name, shape_of
from autoq.qparams import QParam
from autoq.rules import lut_ranges

__all__ = ["SPAN", "cut", "cut_softmax_inputs", "softmax_input_slots"]

#: how far below the scores' minimum the softmax input's grid reaches (module docstring)
SPAN = 16.0


def _softmax_last_axis(call, var) -> bool:
    if op_name(call) != "relax.nn.softmax" or not call.args[0].same_as(var):
        return False
    rank = len(shape_of(var) or ())
    return rank > 0 and int(call.attrs.axis) % rank == rank - 1


def softmax_input_slots(sim) -> dict[str, tuple[str, str]]:
    """slot -> (its add's two operand slots) for every 8-bit ``add`` output slot read only
    by softmax over the last axis (see the module docstring)."""
    g, plan = sim.graph, sim.plan
    slot_of = {var: sid for sid, var in plan.tensors.items()}
    out = {}
    for m in sim.matches:
        if m.pattern.name != "add" or m.layer in plan.dynamic:
            continue
        var = m.root
        sid = slot_of.get(var)
        users = g.users.get(var, [])
        if sid is None or not users or var in set(g.output_vars()):
            continue
        if not all(_softmax_last_axis(g.value[u], var) for u in users):
            continue
        operands = [slot_of.get(m[k]) for k in ("lhs", "rhs")]
        if None in operands or plan.specs[sid].dtype not in LUT_DTYPES:
            continue
        out[sid] = (operands[0], operands[1])
    return out


def cut(qp: QParam, lhs: QParam, rhs: QParam, spec) -> QParam:
    """``qp``, the grid of ``lhs + rhs`` read by a softmax, with its low end raised to the
    non-mask operand's grid minimum minus :data:`SPAN` (as :func:`autoq.rules.lut_ranges.cut`
    cuts: the range keeps 0), when one operand's grid ends at or below 0 (its highest step:
    the mask's 0); unchanged otherwise (per tensor only)."""
    if qp.per_axis or lhs.per_axis or rhs.per_axis:
        return qp
    ranges = [tuple(float(np.reshape(v, -1)[0]) for v in q.grid_range()) for q in (lhs, rhs)]
    steps = [float(np.reshape(q.scale, -1)[0]) for q in (lhs, rhs)]
    masks = [hi <= step for (_, hi), step in zip(ranges, steps, strict=True)]
    if masks == [False, False]:
        return qp
    score_lo = ranges[1][0] if masks[0] else ranges[0][0]
    if masks == [True, True]:
        score_lo = max(ranges[0][0], ranges[1][0])
    return lut_ranges.cut(qp, (score_lo - SPAN, None), spec)


def cut_softmax_inputs(sim, result: dict, config, fixed=()) -> None:
    """Cut, in place, the qparams in ``result`` (slot -> QParam) of every softmax input
    slot (:func:`softmax_input_slots`) whose operands are in ``result``, when
    ``config.has_rule("softmax_input_ranges")``; ``fixed`` slots are kept as given."""
    if not config.has_rule("softmax_input_ranges"):
        return
    for sid, (a, b) in softmax_input_slots(sim).items():
        if sid in result and sid not in fixed and a in result and b in result:
            result[sid] = cut(result[sid], result[a], result[b], sim.plan.specs[sid])
