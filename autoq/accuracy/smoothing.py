"""SmoothQuant's per-channel migration factors, the numpy math (Xiao, Lin, Seznec, Wu, Demouth,
Han 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", ICML, arXiv:2211.10438, eq. 4).

A few input channels of a transformer's dense layers carry activations 10-100x larger than
the rest ("outliers"); a per-tensor int8 grid sized for them leaves the other channels a
handful of levels. A linear layer ``Y = X W`` (``W`` is ``(K, N)``, input channel ``j`` =
row ``j``) computes the same after ``X[:, j] /= s_j`` and ``W[j, :] *= s_j``; the difficulty
moves from the activation (per tensor) into the weight (per output channel, which absorbs it
much better). With ``a`` the migration strength, the paper's choice is

    ``s_j = max|X_j| ** a / max|W_j| ** (1 - a)``

(``a = 0.5`` balances them: both ``max|X_j / s_j|`` and ``max|W_j s_j|`` become
``sqrt(max|X_j| max|W_j|)``). Where the activation comes out of a LayerNorm the division is
free: ``LN(x) * gamma + beta`` with ``gamma / s`` and ``beta / s`` (:mod:`autoq.accuracy.smooth_quant`
does the graph part).
"""

from __future__ import annotations

import numpy as np

__all__ = ["channel_absmax", "smoothing_scales", "weight_absmax"]


def channel_absmax(x) -> np.ndarray:
    """``max |x|`` per channel of the last axis, over every other axis.

    >>> channel_absmax(np.array([[1.0, -4.0], [-2.0, 3.0]])).tolist()
    [2.0, 4.0]
    """
    x = np.asarray(x)
    return np.abs(x.reshape(-1, x.shape[-1])).max(axis=0)


def weight_absmax(weights) -> np.ndarray:
    """Per input channel, ``max |W|`` over every ``(K, N)`` weight reading the same
    activation (one smoothing factor per channel serves them all).

    >>> weight_absmax([np.array([[1.0, -3.0], [0.5, 0.0]]), np.array([[2.0], [-1.0]])]).tolist()
    [3.0, 1.0]
    """
    return np.max([np.abs(np.asarray(w)).max(axis=1) for w in weights], axis=0)


def smoothing_scales(act_max, weight_max, alpha: float = 0.5) -> np.ndarray:
    """``s_j = act_max_j ** alpha / weight_max_j ** (1 - alpha)`` (float64); 1 for a channel
    whose activation or weight maximum is 0 (nothing to migrate).

    An outlier channel (activation 100, weight 1) and an ordinary one (1 and 1), alpha 0.5:
    the outlier is divided by 10, its weight row multiplied by 10, both ranges become 10:

    >>> s = smoothing_scales(np.array([100.0, 1.0, 0.0]), np.array([1.0, 1.0, 3.0]))
    >>> s.tolist()
    [10.0, 1.0, 1.0]
    >>> (np.array([100.0, 1.0]) / s[:2]).tolist(), (np.array([1.0, 1.0]) * s[:2]).tolist()
    ([10.0, 1.0], [10.0, 1.0])
    """
    if not 0 < alpha < 1:
        raise ValueError(f"SmoothQuant's alpha must be in (0, 1), got {alpha!r}")
    a = np.asarray(act_max, np.float64)
    w = np.asarray(weight_max, np.float64)
    if a.shape != w.shape or a.ndim != 1:
        raise ValueError(f"act_max {a.shape} and weight_max {w.shape} must be equal 1-D shapes")
    ok = (a > 0) & (w > 0) & np.isfinite(a) & np.isfinite(w)
    safe_a, safe_w = np.where(ok, a, 1.0), np.where(ok, w, 1.0)
    return np.where(ok, safe_a**alpha / safe_w ** (1.0 - alpha), 1.0)
