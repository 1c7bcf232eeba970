"""Per-channel scales on the residual stream's last axis (``Config.residual_per_channel``).

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
``dynamic``               a dynamic layer's float result (:mod:`autoq.hybrid`): the same
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
lookup, a multiply, an operand that broadcasts, a 16-bit slot (``Config.int16_tensors``
unless ``Config.residual_int16_per_channel``: then it is int16 per channel; an int16
override), a
model output, a 4-D tensor (NCHW: its last axis is a spatial one; a CNN's residual adds
stay as they are).

The int16 escalation (:mod:`autoq.escalation`) counts these slots among its candidates (as
every per-channel slot): one it picks becomes int16 per tensor, or per channel (its int16
ranges observed per channel) with ``Config.residual_int16_per_channel``.

Calibration runs each such slot's calibrator per channel (``observer(axis)``, as for
weights); the scale-health check sees a per-tensor summary
(:class:`autoq.scale_health.HealthCheck`).

>>> sorted({w for w, _ in SERVABLE}), sorted({r for _, r in SERVABLE})
(['add', 'dynamic', 'float'], ['add', 'dynamic', 'float'])
"""

from __future__ import annotations

from .activations import LUT_DTYPES
from .toolkit import dtype_of, shape_of

__all__ = [
    "ADD_PATTERNS", "CONSUMERS", "PRODUCERS", "SERVABLE", "per_channel_slots",
]  # fmt: skip

#: the patterns whose ``qnn.add`` serves per-channel operands and output
ADD_PATTERNS = frozenset({"add", "add_const"})
#: writer kinds (module docstring)
PRODUCERS = ("float", "dynamic", "add")
#: reader kinds (module docstring)
CONSUMERS = ("float", "dynamic", "add")
#: the (writer, reader) pairs a per-channel slot on the last axis is servable for
SERVABLE = frozenset((w, r) for w in PRODUCERS for r in CONSUMERS)


def _is_8bit(config, layer: str, pattern: str) -> bool:
    """(``Config.int16_tensors`` slots are skipped by :func:`per_channel_slots` itself.)"""
    spec = config.layer_spec("activation", layer, pattern)
    return spec.dtype in LUT_DTYPES and not spec.dynamic


def _same_shape_add(m) -> bool:
    """An add whose activation operands have the output's shape (no broadcast)."""
    out = shape_of(m.root)
    keys = ("lhs",) if m.pattern.name == "add_const" else ("lhs", "rhs")
    return out is not None and all(shape_of(m[k]) == out for k in keys)


def _writer(var, roots, covered, dynamic, config) -> str | None:
    m = roots.get(var)
    if m is None:
        return None if var in covered else "float"
    if m.layer in dynamic:
        return "dynamic"
    if m.pattern.name in ADD_PATTERNS and _same_shape_add(m):
        return "add" if _is_8bit(config, m.layer, m.pattern.name) else None
    return None


def _reader(var, use, owner, dynamic, config) -> str | None:
    m = owner.get(use)
    if m is None:
        return "float"
    if m.layer in dynamic:
        return "dynamic"
    if m.pattern.name not in ADD_PATTERNS or not use.same_as(m.root) or not _same_shape_add(m):
        return None
    keys = ("lhs",) if m.pattern.name == "add_const" else ("lhs", "rhs")
    if not any(m[k].same_as(var) for k in keys):
        return None
    return "add" if _is_8bit(config, m.layer, m.pattern.name) else None


def per_channel_slots(g, matches, config, dynamic=frozenset(), slot_id=None) -> dict:
    """``{tensor: (channels, axis)}``: the tensors whose slot is per channel on the last
    axis (module docstring) for ``config`` and the ``matches`` quantized, ``dynamic`` the
    dynamic layers' names, ``slot_id(var)`` the slot id of a tensor (for
    ``Config.int16_tensors``); empty when ``config.residual_per_channel`` is off."""
    if not config.residual_per_channel:
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
        if (
            sid is not None
            and sid in config.int16_tensors
            and not config.residual_int16_per_channel
        ):
            continue  # int16 per tensor (Config.residual_int16_per_channel: per channel)
        writer = _writer(var, roots, owner, dynamic, config)
        readers = [_reader(var, u, owner, dynamic, config) for u in users]
        if writer is None or any((writer, r) not in SERVABLE for r in readers):
            continue
        if "add" not in readers and writer != "add":
            continue  # read only by float ops and dynamic layers: it has no slot
        out[var] = (int(shape[-1]), len(shape) - 1)
    return out
