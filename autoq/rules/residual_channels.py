"""Per-channel scales on the residual stream's last axis (``Config.rules`` "residual_per_channel").

A transformer's residual stream (embedding sums, the residual adds, the LayerNorm inputs
and outputs) carries its outliers in a few hidden channels: one int8 grid per tensor spends
its range on them. When every op that writes or reads such a tensor can serve one grid per
channel of the **last axis** (the hidden dimension), its slot gets per-channel scales and
zero points (``QParam.axis`` = the last axis) at no int16 cost:

========================  ===============================================================
writer (``PRODUCERS``)    how it writes a per-channel grid
========================  ===============================================================
``float``                 a float op outside every match (LayerNorm, reshape, a gather):
                          ``qnn.quantize`` with ``axis``
``dynamic``               a dynamic layer's float result (:mod:`autoq.rules.hybrid`): the same
``add``                   an 8-bit ``add`` / ``add_const`` layer: ``qnn.add`` with a
                          per-channel output scale / zero point along ``axis``
========================  ===============================================================

========================  ===============================================================
reader (``CONSUMERS``)    how it reads one
========================  ===============================================================
``float``                 ``qnn.dequantize`` with ``axis`` (LayerNorm reads float anyway)
``dynamic``               a dynamic layer reads the float tensor (its run-time quantize or
                          its float residual), never the slot's integers
``add``                   an operand of an 8-bit ``add`` / ``add_const`` of the same shape:
                          ``qnn.add`` rescales each channel with its own multiplier
========================  ===============================================================

:data:`SERVABLE` lists the (writer, reader) pairs; a tensor is per channel when its writer
and every reader form a listed pair. Anything else stays per tensor, without error: a
reader that contracts the hidden axis with integers (a static dense / matmul), a table
lookup unless ``Config.rules`` "lookup_per_channel" (below), a multiply, an operand that
broadcasts, a 16-bit slot (``Config.int16_tensors``, an int16 override), a model output, a 4-D tensor (NCHW: its last axis is a spatial one; a CNN's residual adds
stay as they are).

The int16 escalation (:mod:`autoq.fallback.escalation`) counts these slots among its candidates (as
every per-channel slot): one it picks becomes int16 per tensor.


Calibration runs each such slot's calibrator per channel (``observer(axis)``, as for
weights), then widens each channel's range by :data:`HEADROOM` (:func:`widen`: a channel's
range from the calibration tokens alone clips new data); the scale-health check sees a
per-tensor summary (:class:`autoq.calibration.scale_health.HealthCheck`).

**Table lookups** (``Config.rules`` "lookup_per_channel", the last-axis half of
:mod:`autoq.rules.lut_channels`): kind ``lookup``. As a reader, an 8-bit lookup reading the tensor
as its data indexes one 256-entry table per channel (``qnn.lut`` with ``axis``, a
``[C, 256]`` table built from each channel's input grid); as a writer, its table writes
each channel on that channel's output grid (row ``c`` from channel ``c``'s input grid to
its output grid). A transformer's FFN GELU (input written by a dynamic dense layer, output
read by the next one) then has both its slots per channel with no int16. A lookup whose
other slot is 16-bit computes in float (dequantize / quantize per axis). Each kind of
:data:`SLOT_KINDS` counts only with its option on; ``float`` and ``dynamic`` always.

>>> sorted({w for w, _ in SERVABLE}), sorted({r for _, r in SERVABLE})
(['add', 'dynamic', 'float', 'lookup'], ['add', 'dynamic', 'float', 'lookup'])
"""

from __future__ import annotations

from autoq.ir.activations import LUT_DTYPES
from autoq.ir.toolkit import dtype_of, shape_of
from autoq.qparams import QParam
from autoq.rules.lut_channels import LUT_PATTERNS

__all__ = [
    "ADD_PATTERNS", "CONSUMERS", "HEADROOM", "PRODUCERS", "SERVABLE", "SLOT_KINDS",
    "per_channel_slots", "widen",
]  # fmt: skip

#: the patterns whose ``qnn.add`` serves per-channel operands and output
ADD_PATTERNS = frozenset({"add", "add_const"})
#: writer kinds (module docstring)
PRODUCERS = ("float", "dynamic", "add", "lookup")
#: reader kinds (module docstring)
CONSUMERS = ("float", "dynamic", "add", "lookup")
#: the kinds that quantize the tensor themselves (a float op or a dynamic layer reads and
#: writes float: a tensor needs one of these to have a slot), and the rule enabling each
SLOT_KINDS = {"add": "residual_per_channel", "lookup": "lookup_per_channel"}
#: the (writer, reader) pairs a per-channel slot on the last axis is servable for
SERVABLE = frozenset((w, r) for w in PRODUCERS for r in CONSUMERS)


#: each channel's calibrated range times this (:func:`widen`): a channel's range from a few
#: hundred calibration tokens clips the tail of new data, which one grid per tensor spanning
#: the widest channel never does. MiniLM hybrid, residual + GELU per channel, all int8, cos
#: on a 64-sentence choice set: x1.25 0.99469, x1.5 0.99438, x2 0.99375
#: (benchmarks/results/transformer_int16.md, session 11)
HEADROOM = 1.25


def widen(qp: QParam, sim, sid: str) -> QParam:
    """``qp``, the calibrated qparams of slot ``sid`` of ``sim`` (a
    :class:`autoq.simulation.SimResult`), each channel's range times :data:`HEADROOM` when it
    is a per-channel activation slot on the last axis (this module's slots); both
    calibration modes (topological: before the slot's segment runs; fp32)."""
    info = sim.plan.slots[sid]
    rank = len(info.shape)
    if HEADROOM == 1.0 or info.kind != "activation" or rank in (0, 4) or qp.axis != rank - 1:
        return qp
    spec = sim.plan.specs[sid]
    lo, hi = qp.grid_range()
    return QParam.from_range(
        lo * HEADROOM, hi * HEADROOM, spec.dtype, spec.symmetric, spec.narrow_range,
        spec.reduce_range, axis=qp.axis,
    )  # fmt: skip


def _is_8bit(config, layer: str, pattern: str) -> bool:
    """(``Config.int16_tensors`` slots are skipped by :func:`per_channel_slots` itself.)"""
    spec = config.layer_spec("activation", layer, pattern)
    return spec.dtype in LUT_DTYPES and not spec.dynamic


def _same_shape_add(m) -> bool:
    """An add whose activation operands have the output's shape (no broadcast)."""
    out = shape_of(m.root)
    keys = ("lhs",) if m.pattern.name == "add_const" else ("lhs", "rhs")
    return out is not None and all(shape_of(m[k]) == out for k in keys)


def _enabled(kind: str | None, config) -> str | None:
    """``kind``, or None when it is a slot kind whose option is off."""
    option = SLOT_KINDS.get(kind or "")
    return kind if option is None or config.has_rule(option) else None


def _writer(var, roots, covered, dynamic, config) -> str | None:
    m = roots.get(var)
    if m is None:
        return None if var in covered else "float"
    if m.layer in dynamic:
        return "dynamic"
    if m.pattern.name in LUT_PATTERNS:
        return _enabled("lookup", config) if _is_8bit(config, m.layer, m.pattern.name) else None
    if m.pattern.name in ADD_PATTERNS and _same_shape_add(m):
        return _enabled("add", config) if _is_8bit(config, m.layer, m.pattern.name) else None
    return None


def _reader(var, use, owner, dynamic, config) -> str | None:
    m = owner.get(use)
    if m is None:
        return "float"
    if m.layer in dynamic:
        return "dynamic"
    if m.pattern.name in LUT_PATTERNS and m["data"].same_as(var):
        return _enabled("lookup", config) if _is_8bit(config, m.layer, m.pattern.name) else None
    if m.pattern.name not in ADD_PATTERNS or not use.same_as(m.root) or not _same_shape_add(m):
        return None
    keys = ("lhs",) if m.pattern.name == "add_const" else ("lhs", "rhs")
    if not any(m[k].same_as(var) for k in keys):
        return None
    return _enabled("add", config) if _is_8bit(config, m.layer, m.pattern.name) else None


def per_channel_slots(g, matches, config, dynamic=frozenset(), slot_id=None) -> dict:
    """``{tensor: (channels, axis)}``: the tensors whose slot is per channel on the last
    axis (module docstring) for ``config`` and the ``matches`` quantized, ``dynamic`` the
    dynamic layers' names, ``slot_id(var)`` the slot id of a tensor (for
    ``Config.int16_tensors``); empty when every option of :data:`SLOT_KINDS` is off."""
    if not any(config.has_rule(rule) for rule in SLOT_KINDS.values()):
        return {}
    roots = {m.root: m for m in matches}
    owner = {v: m for m in matches for v in m.covered}
    outputs = set(g.output_vars())
    out = {}
    for var in g.users:
        shape = shape_of(var)
        users = g.users.get(var, [])
        if not users or var in outputs or not shape or len(shape) == 4:
            continue  # (4-D: NCHW, whose last axis is spatial)
        if not g.is_data_dependent(var):
            continue
        if shape[-1] < 2 or dtype_of(var) != "float32":
            continue
        sid = slot_id(var) if slot_id is not None else None
        if sid is not None and sid in config.int16_tensors:
            continue  # int16 per tensor
        writer = _writer(var, roots, owner, dynamic, config)
        readers = [_reader(var, u, owner, dynamic, config) for u in users]
        if writer is None or any((writer, r) not in SERVABLE for r in readers):
            continue
        if writer not in SLOT_KINDS and not SLOT_KINDS.keys() & set(readers):
            continue  # read only by float ops and dynamic layers: it has no slot
        out[var] = (int(shape[-1]), len(shape) - 1)
    return out
