"""A held-out gate for empirical bias correction (``BiasCorrection.holdout``).

On the samples it is computed from, the empirical correction (:mod:`autoq.accuracy.bias_correction`)
cannot hurt a layer's pre-activation output: it removes each channel's mean error ``d``,
and ``E[(e - d)^2] = E[e^2] - d^2``. Whether it carries over to other inputs, and whether it
still helps after a ReLU that discards the negative part it was fitted on, is measured
here on samples calibration never saw: the last ``n`` calibration samples
(:func:`autoq.calibration.holdout.split_holdout`) run through topological calibration in a shard of
their own that contributes no statistics (``run_plan(held=...)``), so each layer reads on
them the input it has in the quantized model, every upstream layer's decision included.

The rule, per conv/dense layer with a bias (in topological order, greedy):

    ``err(c) = sum((f(W_q x~ + b + c) - f(W x + b))^2)`` over the held-out rows,

with ``x~`` the layer's quantized input on the held-out samples, ``x`` the fp32 model's
input on the same samples, ``b`` the float bias, ``c`` the correction (per output channel)
and ``f`` the elementwise activation that alone reads the layer's output (relu, clip, a
table activation such as hardswish or GELU: :func:`follower_activation`), the identity
otherwise (pre-activation; also for a layer with a residual add, whose activation reads a
tensor the gate does not compute). The correction is **kept iff** ``err(c) < err(0)``; a tie
drops it. The errors are reported relative to ``sum(f(W x + b)^2)``. Rows: up to
:data:`MAX_ROWS` output positions (tokens) per held-out sample, evenly spaced
(:func:`autoq.accuracy.hessian.even_rows`). A layer with no held-out row (e.g. a token mask leaves
no real token in any held-out sample) is **dropped**: the gate keeps only corrections
shown to help.

The gate can only reject what its held-out samples show: on ResNet-50 (README, "Accuracy
options") the correction helps held-out crops of the calibration photos and hurts crops of
other photos, so it is kept; held-out samples should come from other sources than the rest.

Pure numpy; :class:`HeldRows` is a sink for :meth:`autoq.calibration.shard_runner.ShardRunner.feed`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoq import primitives as P
from autoq.accuracy.hessian import ConvGeometry, conv_unfold, even_rows
from autoq.ir.activations import ACTIVATIONS
from autoq.ir.toolkit import op_name

__all__ = [
    "MAX_ROWS",
    "GateDecision",
    "HeldRows",
    "decide",
    "follower_activation",
    "layer_output",
    "sample_rows",
]

#: held-out output positions (tokens) per sample and layer
MAX_ROWS = 1024


def follower_activation(graph, match) -> Callable[[np.ndarray], np.ndarray] | None:
    """The elementwise activation (numpy, float64) that is the only reader of ``match``'s
    output (a layer of ``graph``, an :class:`autoq.ir.graph.Graph`): relu, clip or a row of
    :data:`autoq.ir.activations.ACTIVATIONS`; None for anything else, and for a layer with a
    residual add (the activation reads ``W x + b + r``, and the gate does not see ``r``)."""
    if "residual" in match.nodes:
        return None
    users = graph.users.get(match.root, [])
    call = graph.value.get(users[0]) if len(users) == 1 else None
    name = op_name(call) if call is not None else ""
    if name == "relax.nn.relu":
        return lambda y: np.maximum(y, 0.0)
    if name == "relax.clip":
        lo, hi = float(call.args[1].value), float(call.args[2].value)
        return lambda y: np.clip(y, lo, hi)
    if name in ACTIVATIONS:
        return ACTIVATIONS[name].f
    return None


def sample_rows(x, geom: ConvGeometry | None, max_rows: int | None = MAX_ROWS) -> np.ndarray:
    """``(G, N, K)``: the input rows of at most ``max_rows`` evenly spaced output positions
    of one sample ``x`` (a conv's im2col patches, :func:`autoq.accuracy.hessian.conv_unfold`; a dense
    layer's rows, ``geom`` None)."""
    x = np.asarray(x, np.float64)
    if geom is not None:
        return conv_unfold(x, geom, max_rows)
    rows = x.reshape(-1, x.shape[-1])
    keep = even_rows(rows.shape[0], max_rows)
    return (rows if keep is None else rows[keep])[None]


def layer_output(wf: np.ndarray, rows: np.ndarray, bias) -> np.ndarray:
    """``(N, G*O)``: the layer ``wf`` (``(G, O, K)``, :meth:`LayerTask.flat`) on ``rows``
    (``(G, N, K)``) plus ``bias``: output channel ``g*O + o`` as the model orders them."""
    y = np.einsum("gok,gnk->ngo", np.asarray(wf, np.float64), rows)
    return y.reshape(rows.shape[1], -1) + np.asarray(bias, np.float64).reshape(-1)


class HeldRows:
    """The rows (:func:`sample_rows`) of the layers reading one slot, from every held-out
    sample fed to :meth:`update`: the slot's values quantized with ``qp`` (dequantized: what
    the layers read), or as they are (``qp`` None: the fp32 model's). ``geoms``: layer ->
    conv geometry (None: dense); layers of equal geometry share their rows."""

    def __init__(self, geoms: dict[str, ConvGeometry | None], qp=None):
        self.geoms, self.qp = geoms, qp
        self.parts: dict[ConvGeometry | None, list[np.ndarray]] = {g: [] for g in geoms.values()}

    def update(self, x) -> None:
        if self.qp is not None:
            qp = self.qp
            ax = (
                qp.axis if qp.per_axis else None
            )  # (a depthwise input: autoq.rules.depthwise_channels)
            x = P.dequantize(
                P.quantize(x, qp.scale, qp.zero_point, qp.dtype, ax), qp.scale, qp.zero_point, ax
            )
        for geom, parts in self.parts.items():
            parts.append(sample_rows(x, geom))

    def rows(self, layer: str) -> np.ndarray | None:
        """``layer``'s rows over every sample fed (None: none was)."""
        parts = self.parts[self.geoms[layer]]
        return np.concatenate(parts, axis=1) if parts else None

    def resolve(self) -> HeldRows:
        return self


@dataclass(frozen=True)
class GateDecision:
    """``kept``: the correction lowered the held-out error; ``error`` / ``corrected``: the
    relative held-out error without / with it (nan: no held-out row); ``rows``: how many."""

    kept: bool
    error: float
    corrected: float
    rows: int


def decide(y_fp, y_q, shift, activation=None) -> GateDecision:
    """The gate (module docstring) for one layer: ``y_fp`` / ``y_q`` the fp32 and quantized
    layer outputs (``(N, C)``, bias included, correction not), ``shift`` the correction
    (``(C,)``), ``activation`` the follower (None: identity).

    A channel whose quantized output is 1 too low everywhere: correcting it by 1 helps,
    by -1 hurts, and a relu that zeroes the fp32 output leaves nothing to correct:

    >>> y = np.array([[2.0], [4.0]])
    >>> decide(y, y - 1, np.array([1.0])).kept, decide(y, y - 1, np.array([-1.0])).kept
    (True, False)
    >>> decide(-y, -y - 1, np.array([1.0]), lambda v: np.maximum(v, 0.0)).kept
    False
    """
    if y_fp is None or y_q is None or len(y_q) == 0:
        return GateDecision(False, float("nan"), float("nan"), 0)
    f = activation or (lambda v: v)
    ref = f(np.asarray(y_fp, np.float64))
    y_q = np.asarray(y_q, np.float64)
    before = float(np.sum((f(y_q) - ref) ** 2))
    after = float(np.sum((f(y_q + np.asarray(shift, np.float64).reshape(-1)) - ref) ** 2))
    norm = float(np.sum(ref**2)) or 1.0
    return GateDecision(after < before, before / norm, after / norm, len(y_q))
