"""Per tensor or per channel for each depthwise input, chosen on held-out samples
(``Config.rules`` "depthwise_per_channel").

A depthwise input's slot is per channel in the graph (:mod:`autoq.rules.depthwise_channels`),
and one grid shared by all channels is the per-channel grid whose channels are equal, so
the choice needs no other graph: calibration decides it per slot from data. Per-channel
ranges fitted on few samples overfit (a channel that is rarely large gets a range its next
input exceeds, and is clipped), a shared grid wastes steps on the narrow channels; which
loses more differs from slot to slot (ImageNet MobileNetV2's early depthwise inputs gain
from their own grids, EfficientNet-Lite0's late wide ones lose).

:func:`held_out_errors` fits both on the first half of the slot's samples and measures, on
the other half, the error each leaves at the depthwise conv's output: the squared
quantization error of channel ``c`` times ``||w_c||^2`` (its filter's energy; the error
summed over the filter's taps, as if independent), per channel. A channel keeps its own
grid when its error is lower there, and only if those channels together at least halve
the slot's error (:func:`own_grids`; measured: every
EfficientNet-Lite0 slot gains less than 2x and loses top-1 when split, ImageNet
MobileNetV2's split slots gain 2.8x or more); the others take the shared grid, as do the
channels that are 0 on every sample (:func:`ranged`: a dead ReLU6 channel). Either way
the final qparams are calibrated on every sample (:func:`shared_grid`: the per-tensor
calibration, repeated over the channels); a slot whose channels all share the grid is
realized as one per-tensor quantize.

>>> x = np.full((4, 2, 1, 1), 0.1, np.float32); x[0, 0] = 8.0; x[3, 1] = 4.0
>>> w = np.ones((2, 1, 1, 1), np.float32)
>>> from autoq.config import QuantSpec
>>> err = held_out_errors([x[i : i + 1] for i in range(4)], QuantSpec(calibrator="max"), w)
>>> (err["per_channel"] > err["per_tensor"]).tolist()  # channel 1 reaches 4 only when held out
[False, True]
"""

from __future__ import annotations

import numpy as np

from autoq import calibrators
from autoq import primitives as P
from autoq.qparams import QParam
from autoq.rules import clip_ranges, depthwise_channels

__all__ = [
    "AXIS",
    "ErrorSink",
    "Part",
    "depthwise_slots",
    "fit",
    "held_out_errors",
    "own_grids",
    "ranged",
    "shared_grid",
]

#: the channel axis of a depthwise input (NCHW)
AXIS = 1


class Part:
    """A sink forwarding to ``sink.update`` only the samples whose index (in feed order)
    is in ``keep``; everything else is dropped."""

    def __init__(self, sink, keep: range):
        self.sink, self.keep, self.i = sink, keep, 0

    def update(self, x) -> None:
        if self.i in self.keep:
            self.sink.update(x)
        self.i += 1


class ErrorSink:
    """Sums, over the samples it is fed, each channel's squared quantize -> dequantize
    error under each of ``qparams`` (name -> QParam on axis 1 or per tensor)."""

    def __init__(self, qparams: dict[str, QParam]):
        self.qparams = qparams
        self.sums: dict[str, np.ndarray] = {}

    def update(self, x) -> None:
        x = np.asarray(x, np.float32)
        axes = tuple(a for a in range(x.ndim) if a != AXIS)
        for name, qp in self.qparams.items():
            q = P.quantize(x, qp.scale, qp.zero_point, qp.dtype, qp.axis)
            e = P.dequantize(q, qp.scale, qp.zero_point, qp.axis) - x
            s = np.sum(np.square(e, dtype=np.float64), axis=axes)
            self.sums[name] = self.sums.get(name, 0.0) + s


def fit(feed, spec, axis, keep: range | None = None) -> QParam:
    """``spec``'s calibrator over the samples ``keep`` (None: all) of ``feed``
    (``feed(sink)``: every sample to ``sink.update`` in order, returns the sink), a range
    pass first for histogram calibrators; ``axis``: None per tensor, else per channel."""
    cal = spec.calibrator

    def fed(sink):
        return feed(sink) if keep is None else feed(Part(sink, keep)).sink

    data_range = None
    if getattr(cal, "needs_range", False):
        data_range = fed(calibrators.range_observer(axis)).data_range()
    return fed(cal.observer(axis=axis, data_range=data_range)).compute(spec)


def held_out_errors(samples, spec, weight, feed=None) -> dict[str, np.ndarray]:
    """``{"per_channel": e, "per_tensor": e}``: the depthwise-output error each granularity
    leaves on the second half of the slot's samples when fitted on the first (module doc).
    ``samples``: the slot's input on each sample (NCHW), or with ``feed`` (a function
    giving every sample to ``sink.update`` in order and returning the sink) their count;
    ``weight``: the depthwise filters ``[C, 1, KH, KW]``."""
    if feed is None:
        items = list(samples)

        def feed(sink):
            for x in items:
                sink.update(x)
            return sink

        samples = len(items)
    n = int(samples)
    first, held = range(n // 2), range(n // 2, n)
    qps = {"per_channel": fit(feed, spec, AXIS, first), "per_tensor": fit(feed, spec, None, first)}
    sums = feed(Part(ErrorSink(qps), held)).sink.sums
    energy = np.sum(np.square(np.asarray(weight, np.float64)).reshape(len(weight), -1), axis=1)
    return {k: energy * v for k, v in sums.items()}


def own_grids(per_channel: np.ndarray, per_tensor: np.ndarray, gain: float = 2.0) -> np.ndarray:
    """Which channels take their own grid, from their held-out errors on their own grid
    (``per_channel``) and on the shared one (``per_tensor``): those where their own is
    lower, provided that this lowers the slot's error ``gain`` times; else none.

    >>> own_grids(np.array([1.0, 5.0, 0.5]), np.array([4.0, 2.0, 4.0])).tolist()
    [True, False, True]
    >>> own_grids(np.array([3.0, 3.0]), np.array([4.0, 4.0])).tolist()  # 8 -> 6: too little
    [False, False]
    """
    own = per_channel <= per_tensor
    mixed = np.sum(np.where(own, per_channel, per_tensor))
    return own if gain * mixed <= np.sum(per_tensor) else np.zeros_like(own)


def ranged(qp: QParam) -> np.ndarray:
    """Which channels of per-channel qparams ``qp`` were calibrated on a non-empty range.

    A channel that is 0 on every calibration sample (a dead ReLU6 channel) has no range of
    its own and gets :func:`autoq.primitives.choose_qparams`' degenerate grid (scale 1,
    zero point 0). That grid does not start at the ReLU6's 0, so the ReLU6 could not drop
    into the producing conv's requantize and would stay in float between dequantize and
    quantize; such a channel takes the shared grid instead, on which 0 is exact too (the
    integers the depthwise conv reads, ``x - z_x``, stay 0). Qparams that record no range
    count as ranged.

    >>> qp = QParam(np.float32([1.0, 0.02]), np.int32([0, -128]), "int8", AXIS,
    ...             np.float32([0.0, 0.0]), np.float32([0.0, 5.1]))
    >>> ranged(qp).tolist()
    [False, True]
    """
    if qp.rmin is None or qp.rmax is None:
        return np.ones(np.shape(qp.scale), bool)
    return np.broadcast_to(np.asarray(qp.rmax) > np.asarray(qp.rmin), np.shape(qp.scale)).copy()


def depthwise_slots(sim) -> dict[str, np.ndarray]:
    """``{slot: depthwise filters [C, 1, KH, KW]}``: the per-channel depthwise-input slots
    of simulation ``sim`` written by a clip (ReLU6,
    :func:`autoq.rules.depthwise_channels.depthwise_inputs`), each with the float weight of
    the conv reading it. (Those a lookup or a conv writes stay per channel.)"""
    tensors = depthwise_channels.depthwise_inputs(sim.graph, sim.matches, sim.config)
    if not tensors:
        return {}
    out = {}
    for sid, var in sim.plan.tensors.items():
        if var not in tensors or sim.plan.slots[sid].axis != AXIS:
            continue
        if not clip_ranges.is_finite_clip(sim.graph.value.get(var)):
            continue
        layer = tensors[var][1]
        weights = [w for w in sim.layer_slots.get(layer, []) if w in sim.plan.weights]
        if weights:
            out[sid] = sim.plan.weights[weights[0]][0]
    return out


def shared_grid(qp: QParam, channels: int, own: QParam | None = None, keep=None) -> QParam:
    """Per-tensor qparams ``qp`` as the per-channel qparams of ``channels`` equal channels;
    with ``own`` (per-channel qparams) and ``keep`` (a boolean per channel), the channels
    ``keep`` says take their ``own`` grid instead.

    >>> shared_grid(QParam(np.float32(0.5), 3), 2).scale.tolist()
    [0.5, 0.5]
    >>> own = QParam(np.float32([0.1, 0.2]), np.int32([0, 1]), "int8", AXIS)
    >>> shared_grid(QParam(np.float32(0.5), 3), 2, own, np.array([False, True])).zero_point.tolist()
    [3, 1]
    """
    fields = [np.broadcast_to(v, (channels,)) for v in (qp.scale, qp.zero_point, *_range(qp))]
    if own is not None:
        fields = [
            np.where(keep, o, f)
            for o, f in zip((own.scale, own.zero_point, *_range(own)), fields, strict=True)
        ]
    scale, zero_point, rmin, rmax = fields
    return QParam(scale, zero_point, qp.dtype, AXIS, rmin, rmax)


def _range(qp: QParam) -> tuple:
    """The real range ``qp`` was chosen for (its grid's when it records none)."""
    lo, hi = qp.grid_range()
    return (lo if qp.rmin is None else qp.rmin), (hi if qp.rmax is None else qp.rmax)
