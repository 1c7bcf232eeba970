"""Per-channel scales on the inputs of table-lookup activations (``Config.rules`` "lookup_per_channel").

A conv's output read only by one 8-bit table-lookup layer (hardswish, sigmoid, ... and their
``_affine`` forms; ``patterns/activation.py``, ``patterns/activation_affine.py``) need not
share one grid across its channels: the conv's requantize takes a per-channel output scale
and zero point (the int32 accumulator is already per channel: ``s_x * s_w[c]``), and the
lookup indexes one 256-entry table per channel (``qnn.lut`` with a ``[C, 256]`` table and
``axis``), each computed from that channel's input grid and the *per-tensor* output grid.
Nothing downstream changes: the table's output is one int8 tensor as before. (On the last
axis of a non-4-D tensor, e.g. a transformer's GELU between dynamic dense layers, the same
option makes the lookup's input and output per channel: kind ``lookup`` of
:mod:`autoq.rules.residual_channels`.)

Which tensors (:func:`per_channel_inputs`): the root of a ``conv2d*`` match with a 4-D
output (channels on axis 1) whose every use is inside one lookup match reading it as its
data (no float op, second layer or model output reads it), both the slot and the lookup's
output 8-bit (a 16-bit slot computes the activation in float: per tensor). Anything else
stays per tensor (the option never errors on a model: the shapes it cannot serve are left
as they were).

Calibration: the slot's calibrator runs per channel (``observer(axis=1)``: every built-in
one supports it, as for weights; ``kl`` and ``mse`` then search each channel's histogram,
C times the work of one). ``Config.rules`` "lookup_input_ranges" cuts each channel's range
(:func:`cut`). The scale-health check sees the grid covering every channel's range, a
per-tensor summary (:class:`autoq.calibration.scale_health.HealthCheck`).

>>> from autoq.qparams import QParam
>>> qp = QParam(np.array([0.1, 0.2], np.float32), np.array([-10, 5]), "int8", 1)
>>> tables("hardswish", qp, QParam(np.float32(0.05), 0)).shape
(2, 256)
"""

from __future__ import annotations

import numpy as np

from autoq.ir.activations import ACTIVATIONS, LUT_DTYPES, lut_table
from autoq.ir.toolkit import shape_of
from autoq.qparams import QParam

__all__ = ["AXIS", "LUT_PATTERNS", "cut", "lut_axis", "per_channel_inputs", "table", "tables"]

#: the channel axis of a conv2d output (NCHW)
AXIS = 1
#: names of the table-lookup patterns
LUT_PATTERNS = frozenset(
    n for act in ACTIVATIONS.values() for n in (act.name, f"{act.name}_affine")
)
_PRODUCERS = ("conv2d", "conv2d_bias", "conv2d_add", "conv2d_bias_add")


def per_channel_inputs(g, matches, config) -> dict:
    """``{tensor: (channels, lookup layer)}``: the conv outputs whose slot is per channel
    (module docstring), for ``config`` (its specs and ``int16_tensors``); empty when
    ``config.has_rule("lookup_per_channel")`` is off."""
    if not config.has_rule("lookup_per_channel"):
        return {}
    roots = {m.root: m for m in matches}
    outputs = set(g.output_vars())
    out = {}
    for m in matches:
        if m.pattern.name not in LUT_PATTERNS:
            continue
        var = m["data"]
        prod = roots.get(var)
        if prod is None or prod.pattern.name not in _PRODUCERS or var in outputs:
            continue
        shape = shape_of(var)
        users = g.users.get(var, [])
        if shape is None or len(shape) != 4 or not users:
            continue
        if any(u not in m.covered for u in users):
            continue
        specs = [config.layer_spec("activation", m.layer, m.pattern.name, s)
                 for s in (prod.layer, m.layer)]  # fmt: skip
        if all(spec.dtype in LUT_DTYPES for spec in specs):
            out[var] = (int(shape[AXIS]), m.layer)
    return out


def tables(activation, a: QParam, b: QParam) -> np.ndarray:
    """The ``[C, 256]`` tables of ``activation`` from the input grid ``a`` to the output
    grid ``b``, either or both per channel (row ``c``: :func:`autoq.ir.activations.lut_table`
    of channel ``c``)."""
    s, z = np.asarray(a.scale).reshape(-1), np.asarray(a.zero_point).reshape(-1)
    # a per-channel output grid (autoq.rules.depthwise_channels): row c writes channel c's grid
    n = max(s.size, np.size(b.scale))
    s, z = np.broadcast_to(s, (n,)), np.broadcast_to(z, (n,))
    bs = np.broadcast_to(np.asarray(b.scale).reshape(-1), (n,))
    bz = np.broadcast_to(np.asarray(b.zero_point).reshape(-1), (n,))
    return np.stack(
        [
            lut_table(activation, sc, zc, a.dtype, bsc, bzc, b.dtype)
            for sc, zc, bsc, bzc in zip(s, z, bs, bz, strict=True)
        ]
    )


def lut_axis(a: QParam, b: QParam) -> int | None:
    """The ``qnn.lut`` axis of a lookup from grid ``a`` to grid ``b``: the channel axis when
    either is per channel (one table row per channel, :func:`table`), else None."""
    return a.axis if a.per_axis else (b.axis if b.per_axis else None)


def table(activation, a: QParam, b: QParam) -> np.ndarray:
    """The table of a lookup from input grid ``a`` (per tensor: 256 entries; per channel:
    ``[C, 256]``) to output grid ``b``."""
    if a.per_axis or b.per_axis:
        return tables(activation, a, b)
    return lut_table(activation, a.scale, a.zero_point, a.dtype, b.scale, b.zero_point, b.dtype)


def cut(qp: QParam, bounds: tuple[float | None, float | None], spec) -> QParam:
    """Per-channel ``qp`` with each channel's range cut to ``bounds`` (see
    :func:`autoq.rules.lut_ranges.cut`; a channel whose range lies inside keeps its qparams)."""
    rmin, rmax = qp.grid_range()
    lo, hi = bounds
    new_min = rmin if lo is None else np.maximum(rmin, min(lo, 0.0))
    new_max = rmax if hi is None else np.minimum(rmax, max(hi, 0.0))
    if np.array_equal(new_min, rmin) and np.array_equal(new_max, rmax):
        return qp
    new = QParam.from_range(
        new_min, new_max, spec.dtype, spec.symmetric, spec.narrow_range, spec.reduce_range,
        axis=qp.axis,
    )  # fmt: skip
    same = (new_min == rmin) & (new_max == rmax)
    scale = np.where(same, qp.scale, new.scale).astype(np.float32)
    zp = np.where(same, qp.zero_point, new.zero_point).astype(np.int32)
    return QParam(scale, zp, qp.dtype, qp.axis, new_min, new_max)
