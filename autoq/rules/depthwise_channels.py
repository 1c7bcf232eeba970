"""Per-channel grids on the inputs of depthwise convs (``Config.rules`` "depthwise_per_channel").

A depthwise conv (``groups`` == input channels == output channels, one ``[1, KH, KW]``
filter per channel) reads only input channel ``c`` for output channel ``c``, so its input
need not share one grid across channels: with input scale ``s_x[c]`` and zero point
``z_x[c]`` the int32 accumulator of channel ``c`` is ``sum (x - z_x[c]) * (w - z_w[c])``
on the grid ``s_x[c] * s_w[c]``, which the requantize after it takes per channel as it
already does for the weight scales: exact in integers. Padding pads the real value 0, i.e.
``z_x[c]`` in channel ``c`` (the kernels pad the centered value ``x - z_x[c]`` with 0).
What writes that input onto per-channel grids costs nothing more either:

- an 8-bit table lookup (hardswish, ... and their ``_affine`` forms): its ``[C, 256]``
  table (``qnn.lut`` with ``axis``, :mod:`autoq.rules.lut_channels`) maps into each channel's
  own grid;
- a ``conv2d*`` layer: its requantize takes a per-channel output scale and zero point (the
  int32 accumulator is already per channel; ``autoq.realization.propagate`` merges the
  per-axis quantize of its dequantize into one per-channel ``qnn.requantize``).

Which tensors (:func:`depthwise_inputs`): a 4-D tensor written by one of those, not a
model output, whose every use is one ``conv2d*`` match reading it as its data (not as a
residual), that conv depthwise with channel multiplier 1 and not dynamic, the slot 8-bit
(``Config.int16_tensors`` and overrides included; for a lookup its input too: a 16-bit side
computes the activation in float). Anything else stays per tensor (the option never errors
on a model). A lookup output that another layer also reads (PP-OCRv4 det: 3 of the 14
depthwise inputs, also read by a 1x1 conv of the neck) stays per tensor: a dense conv
cannot take per-channel input scales in integers.

Integer paths: ``qnn.conv2d`` accepts per-channel input qparams only when depthwise
(:mod:`autoq.qnn.accumulate`: the generic legalization widens ``x - z_x[c]`` to int32 and
pads with 0); the packed CPU depthwise kernels take the zero points as a ``[C]`` constant
(:mod:`autoq.cpu.depthwise`; the input is then read in NCHW, never a blocked layout).
Calibration observes the slot per channel (``observer(axis=1)``); weight tuning keeps the
per-channel input's Hessians in integer codes (GPTQ and the scale search are invariant to
a positive factor per group) and turns each group's mean patch into reals with ``s_x[c]``
(:func:`group_scales`).
"""

from __future__ import annotations

import numpy as np

from autoq.ir.activations import LUT_DTYPES
from autoq.ir.toolkit import shape_of
from autoq.qnn.accumulate import depthwise_shape
from autoq.rules import clip_ranges, hybrid
from autoq.rules.lut_channels import AXIS, LUT_PATTERNS

__all__ = ["AXIS", "depthwise_inputs", "group_scales", "is_depthwise"]

_CONV = ("conv2d", "conv2d_bias", "conv2d_add", "conv2d_bias_add")


def is_depthwise(g, m, channels: int) -> bool:
    """Whether conv match ``m`` is a depthwise conv of ``channels`` channels with channel
    multiplier 1 (weight ``[C, 1, KH, KW]``, ``groups == C``)."""
    core = g.value.get(m["core"])
    ref = g.weight_of(m["weight"])
    if core is None or ref is None:
        return False
    return depthwise_shape(channels, ref.array.shape, int(core.attrs.groups))


def depthwise_inputs(g, matches, config) -> dict:
    """``{tensor: (channels, depthwise layer)}``: the depthwise inputs whose slot is per
    channel (module docstring), for ``config``; empty when
    ``config.has_rule("depthwise_per_channel")`` is off."""
    if not config.has_rule("depthwise_per_channel"):
        return {}
    roots = {m.root: m for m in matches}
    outputs = set(g.output_vars())
    dynamic = hybrid.dynamic_names(config, matches)
    out = {}
    for m in matches:
        lookup = m.pattern.name in LUT_PATTERNS
        if not (lookup or m.pattern.name in _CONV) or m.root in outputs:
            continue
        var = _through_clip(g, m.root)
        if var in outputs:
            continue
        shape = shape_of(var)
        users = g.users.get(var, [])
        if shape is None or len(shape) != 4 or not users:
            continue
        conv = _only_reader(users, matches)
        if conv is None or conv.pattern.name not in _CONV or conv.layer in dynamic:
            continue
        residual = conv.get("residual")
        if not conv["data"].same_as(var) or (residual is not None and residual.same_as(var)):
            continue
        channels = int(shape[AXIS])
        if not is_depthwise(g, conv, channels):
            continue
        # the slot's spec: the lookup's (it writes the slot) or the depthwise conv's (the
        # first reader of a conv's output creates its slot: autoq.simulate)
        owner = m if lookup else conv
        specs = [config.layer_spec("activation", owner.layer, owner.pattern.name, m.layer)]
        if lookup:
            prod = roots.get(m["data"])
            in_sid = prod.layer if prod is not None else g.ids.get(m["data"], "")
            specs.append(config.layer_spec("activation", m.layer, m.pattern.name, in_sid))
        if all(spec.dtype in LUT_DTYPES for spec in specs):
            out[var] = (channels, conv.layer)
    return out


def _through_clip(g, var):
    """The tensor a layer's output ``var`` is read as: the output of the ``clip`` with
    finite bounds (ReLU6) that is its only reader, else ``var`` itself."""
    users = g.users.get(var, [])
    if len(users) == 1 and clip_ranges.is_finite_clip(g.value.get(users[0])):
        return users[0]
    return var


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
            "Config.rules 'depthwise_per_channel' serves depthwise convs only"
        )
    return s.astype(np.float32).astype(np.float64).reshape(groups, 1)
