"""SmoothQuant's migration strength chosen per LayerNorm by the output error of the dense
layers it feeds (``Config.smooth_quant_alphas``).

SmoothQuant (Xiao et al. 2023, arXiv:2211.10438, sec. 4 and fig. 10) picks one migration
strength ``alpha`` for the whole model from a sweep of the end metric. The layers differ,
though: a LayerNorm whose output has a few channels 50x above the rest wants most of the
range moved into the weights, one with an even output wants little. AWQ (Lin et al. 2024,
"AWQ: Activation-aware Weight Quantization", MLSys, arXiv:2306.00978, sec. 3.2 "searching to
scale") searches the exponent of the same kind of per-channel factor ``s = s_X ** alpha``
per layer on a grid, by the layer's output error. This module does that search for
SmoothQuant's factor ``s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)``:

for each ``alpha`` of the grid and the LayerNorm output rows ``X`` (calibration samples,
fp32) and the ``(K, N)`` weights ``W_m`` of the dense layers reading it,

    ``err(alpha) = sum_m ||Q_a(X / s) Q_w(W_m * s) - X W_m||^2 / ||X W_m||^2``

with ``Q_a`` the activation spec's per-tensor quantization (its calibrator run on ``X / s``,
as calibration would) and ``Q_w`` the weight spec's (per output channel), round to nearest;
the ``alpha`` with the smallest error wins (ties: the first in the grid). Numpy only; the
graph part (collecting ``X``, rewriting) is :mod:`autoq.smooth_quant`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .calibrate import observe
from .config import QuantSpec
from .metrics import fake_quant
from .smoothing import smoothing_scales, weight_absmax

__all__ = ["group_error", "reference_outputs", "search_alpha"]


def _act_fake_quant(x: np.ndarray, spec: QuantSpec) -> np.ndarray:
    qp = observe(spec, [x], None, lambda: [x])
    return fake_quant(x, qp)[0]


def _weight_fake_quant(w: np.ndarray, spec: QuantSpec) -> np.ndarray:
    axis = 1 if spec.per_channel else None
    qp = observe(spec, [w], axis, lambda: [w], channels=w.shape[1])
    return fake_quant(w, qp)[0]


def group_error(
    x: np.ndarray,
    weights: Sequence[np.ndarray],
    scale: np.ndarray,
    act_spec: QuantSpec,
    weight_spec: QuantSpec,
    refs: Sequence[np.ndarray] | None = None,
) -> float:
    """``sum_m ||Q_a(x / s) Q_w(W_m * s) - x W_m||^2 / ||x W_m||^2`` (module docstring) for
    rows ``x`` ``(n, K)``, weights ``(K, N_m)`` and factors ``scale`` ``(K,)``; ``refs``:
    the float64 products ``x W_m`` when already computed (:func:`reference_outputs`)."""
    x = np.asarray(x, np.float32)
    s = np.asarray(scale, np.float64)
    xq = _act_fake_quant((x / s).astype(np.float32), act_spec)
    refs = reference_outputs(x, weights) if refs is None else refs
    total = 0.0
    for w, ref in zip(weights, refs, strict=True):
        w = np.asarray(w, np.float32)
        wq = _weight_fake_quant((w * s[:, None]).astype(np.float32), weight_spec)
        d = xq.astype(np.float64) @ wq.astype(np.float64) - ref
        total += float(np.sum(d * d) / max(np.sum(ref * ref), 1e-30))
    return total


def reference_outputs(x: np.ndarray, weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The float64 products ``x W_m`` (the reference :func:`group_error` compares with; the
    same for every alpha)."""
    x64 = np.asarray(x, np.float32).astype(np.float64)
    return [x64 @ np.asarray(w, np.float32).astype(np.float64) for w in weights]


def search_alpha(
    x: np.ndarray,
    act_max: np.ndarray,
    weights: Sequence[np.ndarray],
    alphas: Sequence[float],
    act_spec: QuantSpec,
    weight_spec: QuantSpec,
) -> tuple[float, np.ndarray, dict[float, float]]:
    """(best alpha, its factors ``s``, ``{alpha: group_error}``) over ``alphas`` for the rows
    ``x`` of a LayerNorm output (``act_max``: its channel maxima over all samples) and the
    weights reading it; the weight maxima are taken over every weight (one ``s`` per channel
    for all of them, as SmoothQuant rewrites the LayerNorm once)."""
    if not alphas:
        raise ValueError("search_alpha needs at least one alpha")
    wmax = weight_absmax(weights)
    refs = reference_outputs(x, weights)
    errors: dict[float, float] = {}
    best = None
    for a in alphas:
        s = smoothing_scales(act_max, wmax, a)
        errors[a] = group_error(x, weights, s, act_spec, weight_spec, refs)
        if best is None or errors[a] < best[1]:
            best = (a, errors[a], s)
    return best[0], best[2], errors
