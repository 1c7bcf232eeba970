"""Per-channel grids on the inputs of depthwise convs written by a table lookup
(``Config.lut_output_per_channel``).

A depthwise conv (``groups`` == input channels == output channels, one ``[1, KH, KW]``
filter per channel) reads only input channel ``c`` for output channel ``c``, so its input
need not share one grid across channels: with input scale ``s_x[c]`` and zero point
``z_x[c]`` the int32 accumulator of channel ``c`` is ``sum (x - z_x[c]) * (w - z_w[c])``
on the grid ``s_x[c] * s_w[c]``, which the requantize after it takes per channel as it
already does for the weight scales. Padding pads the real value 0, i.e. ``z_x[c]`` in
channel ``c`` (the kernels pad the centered value ``x - z_x[c]`` with 0). When that input
is the output of an 8-bit table lookup (hardswish, ... and their ``_affine`` forms), the
lookup's ``[C, 256]`` table (``qnn.lut`` with ``axis``, :mod:`autoq.lut_channels`) writes
each channel straight onto its own grid: no op is added anywhere.

Which tensors (:func:`per_channel_outputs`): the root of a lookup match with a 4-D output
whose every use is one ``conv2d*`` match reading it as its data (not as a residual), that
conv depthwise with channel multiplier 1 and not dynamic, the lookup's input and output
8-bit (``Config.int16_tensors`` and overrides included: a 16-bit side computes the
activation in float). Anything else stays per tensor (the option never errors on a model).

Integer paths: ``qnn.conv2d`` accepts per-channel input qparams only when depthwise
(:mod:`autoq.qnn.accumulate`: the generic legalization widens ``x - z_x[c]`` to int32 and
pads with 0); the packed CPU depthwise kernels take the zero points as a ``[C]`` constant
(:mod:`autoq.cpu.depthwise`). Calibration observes the slot per channel (``observer(axis=1)``);
weight tuning scales each group's Hessian by nothing (GPTQ and the scale search are
invariant to a positive factor per group) and each group's mean patch by ``s_x[c]``
(:func:`group_scales`).
"""

from __future__ import annotations

import numpy as np

from . import hybrid
from .activations import LUT_DTYPES
from .lut_channels import AXIS, LUT_PATTERNS
from .toolkit import shape_of

__all__ = ["AXIS", "group_scales", "is_depthwise", "lut_axis", "per_channel_outputs"]

_CONSUMERS = ("conv2d", "conv2d_bias", "conv2d_add", "conv2d_bias_add")


def is_depthwise(g, m, channels: int) -> bool:
    """Whether conv match ``m`` is a depthwise conv of ``channels`` channels with channel
    multiplier 1 (weight ``[C, 1, KH, KW]``, ``groups == C``)."""
    core = g.value.get(m["core"])
    ref = g.weight_of(m["weight"])
    if core is None or ref is None or ref.array.ndim != 4:
        return False
    groups = int(core.attrs.groups)
    return groups == channels and tuple(ref.array.shape[:2]) == (channels, 1)


def _spec_dtype(config, m, sid: str) -> str:
    spec = config.layer_spec("activation", m.layer, m.pattern.name)
    return (spec.as_int16() if sid in config.int16_tensors else spec).dtype


def per_channel_outputs(g, matches, config) -> dict:
    """``{tensor: (channels, depthwise layer)}``: the lookup outputs whose slot is per
    channel (module docstring), for ``config``; empty when ``config.lut_output_per_channel``
    is off."""
    if not config.lut_output_per_channel:
        return {}
    roots = {m.root: m for m in matches}
    outputs = set(g.output_vars())
    dynamic = hybrid.dynamic_names(config, matches)
    out = {}
    for m in matches:
        if m.pattern.name not in LUT_PATTERNS or m.root in outputs:
            continue
        var, shape = m.root, shape_of(m.root)
        users = g.users.get(var, [])
        if shape is None or len(shape) != 4 or not users:
            continue
        conv = _only_reader(users, matches)
        if conv is None or conv.pattern.name not in _CONSUMERS or conv.layer in dynamic:
            continue
        residual = conv.get("residual")
        if not conv["data"].same_as(var) or (residual is not None and residual.same_as(var)):
            continue
        channels = int(shape[AXIS])
        if not is_depthwise(g, conv, channels):
            continue
        prod = roots.get(m["data"])
        in_sid = prod.layer if prod is not None else g.ids.get(m["data"], "")
        in_dtype = _spec_dtype(config, m, in_sid)
        if in_dtype in LUT_DTYPES and _spec_dtype(config, m, m.layer) in LUT_DTYPES:
            out[var] = (channels, conv.layer)
    return out


def _only_reader(users, matches):
    """The one match covering every binding in ``users``, or None."""
    for c in matches:
        if all(u in c.covered for u in users):
            return c
    return None


def group_scales(scale, groups: int) -> np.ndarray | float:
    """The factor turning a weight-tuning group's input codes into reals: the per-tensor
    scale (a float), or ``[G, 1]`` per-channel scales of a depthwise input (one group per
    channel); an error naming the option when the lengths disagree."""
    s = np.asarray(scale, np.float64).reshape(-1)
    if s.size == 1:
        return float(np.float32(s[0]))
    if s.size != groups:
        raise ValueError(
            f"a per-channel input scale ({s.size} channels) on a layer of {groups} groups: "
            "Config.lut_output_per_channel serves depthwise convs only"
        )
    return s.astype(np.float32).astype(np.float64).reshape(groups, 1)


def lut_axis(a, b) -> int | None:
    """The ``qnn.lut`` axis of a lookup from grid ``a`` to grid ``b``: the channel axis when
    either is per channel (one table row per channel), else None."""
    return a.axis if a.per_axis else (b.axis if b.per_axis else None)
