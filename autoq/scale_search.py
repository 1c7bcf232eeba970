"""Per-channel weight scales chosen by the layer's *output* error, not by the weight range.

The max calibrator gives each output channel ``scale = max|w| / 127``: no weight is clipped,
but one outlier weight coarsens the grid of the whole channel. Clipping the channel at
``ratio * max|w|`` trades clipping error on the few large weights for rounding error on all
the others. This module picks, per output channel, the ratio on a grid that minimizes

    ``dw_r H dw_r^T``  (``dw_r`` = the channel's round-to-nearest error at that scale)

with ``H = 2 X^T X / n`` of the layer's inputs (:class:`autoq.hessian.Hessian`): the output
MSE ``||X dW^T||^2`` of that channel on the calibration data, up to ``2/n``. Without ``H``
it is the plain weight MSE. Channels are independent (the output error is a sum over
output rows), so the per-channel grid search is exact for its grid.

References: output-space MSE range setting ("OMSE", Choukroun, Kravchik, Yang, Kisilev
2019, "Low-bit Quantization of Neural Networks for Efficient Inference"); the MSE grid
search over clipping ratios of Nagel et al. 2021, "A White Paper on Neural Network
Quantization", sec. 3.4 (here weighted by H, i.e. the layer's output instead of its weights);
GPTQ's reference code searches the same grid in weight space.

Symmetric scales only (autoq's weight default; zero point fixed at the middle of the range).
The search costs one matmul ``(O, K) x (K, K)`` per grid point: well under a second for a
1280-input layer with 51 ratios. GPTQ (:mod:`autoq.gptq`) can then round with these scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gptq import rtn
from .hessian import output_error

__all__ = ["DEFAULT_RATIOS", "ScaleSearch", "search_scales"]

#: 1.00, 0.99, ..., 0.50 of the channel's max |w|
DEFAULT_RATIOS = np.round(np.arange(100, 49, -1) / 100.0, 2)


@dataclass(frozen=True)
class ScaleSearch:
    """Per output channel (``G*O`` values, flattened like an OIHW kernel's axis 0):
    ``scale`` (float32) and ``ratio`` chosen, ``error`` there and ``error_max`` at ratio 1
    (``dw H dw^T``, or the summed squared weight error without H)."""

    scale: np.ndarray
    ratio: np.ndarray
    error: np.ndarray
    error_max: np.ndarray


def _scales(amax: np.ndarray, ratio: float, qmin: int, qmax: int) -> np.ndarray:
    s = (amax * ratio / ((qmax - qmin) / 2.0)).astype(np.float32)
    return np.where(s < np.finfo(np.float32).tiny, np.float32(1.0), s)


def search_scales(
    w,
    h=None,
    qmin: int = -127,
    qmax: int = 127,
    ratios=DEFAULT_RATIOS,
) -> ScaleSearch:
    """Symmetric per-channel scales minimizing each channel's output error (module doc).

    ``w``: ``(out, in)`` or ``(G, out, in)`` (:func:`autoq.hessian.flatten_conv_weight`);
    ``h``: ``(in, in)`` / ``(G, in, in)`` or None (weight MSE). Ties keep the earlier
    ratio of ``ratios`` (the default starts at 1.0, the max calibrator's choice).

    256 normal weights and one outlier of 12 on a 4-bit grid: clipping the outlier at
    0.67 of its value (scale 1.15 instead of 1.71) costs 16 on it and saves more on the
    256 others:

    >>> w = np.random.default_rng(0).normal(size=(1, 256))
    >>> w[0, 0] = 12.0
    >>> r = search_scales(w, qmin=-7, qmax=7)
    >>> float(r.ratio[0]), round(float(r.error[0]), 1), round(float(r.error_max[0]), 1)
    (0.67, 43.8, 61.5)
    """
    w = np.asarray(w, np.float64)
    flat = w.ndim == 2
    w3 = w[None] if flat else w
    h3 = None if h is None else np.asarray(h, np.float64)
    if h3 is not None and h3.ndim == 2:
        h3 = h3[None]
    if h3 is not None and h3.shape != (w3.shape[0], w3.shape[2], w3.shape[2]):
        raise ValueError(f"h {h3.shape} does not fit w {w.shape}")
    ratios = np.asarray(ratios, np.float64).reshape(-1)
    if ratios.size == 0 or np.any(ratios <= 0):
        raise ValueError("ratios must be a non-empty list of positive numbers")
    amax = np.abs(w3).max(axis=2)
    zp = (qmin + qmax + 1) // 2
    best_err = best_scale = best_ratio = err_max = None
    for ratio in ratios:
        s = _scales(amax, ratio, qmin, qmax)
        dw = w3 - (rtn(w3, s, zp, qmin, qmax) - zp) * s[..., None].astype(np.float64)
        err = (dw**2).sum(axis=2) if h3 is None else output_error(dw, h3)
        if best_err is None:
            best_err, best_scale, best_ratio = err, s, np.full(err.shape, ratio)
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_scale = np.where(better, s, best_scale)
            best_ratio = np.where(better, ratio, best_ratio)
        if ratio == 1.0:
            err_max = err
    if err_max is None:
        s = _scales(amax, 1.0, qmin, qmax)
        dw = w3 - (rtn(w3, s, zp, qmin, qmax) - zp) * s[..., None].astype(np.float64)
        err_max = (dw**2).sum(axis=2) if h3 is None else output_error(dw, h3)
    return ScaleSearch(
        best_scale.reshape(-1).astype(np.float32),
        best_ratio.reshape(-1),
        best_err.reshape(-1),
        err_max.reshape(-1),
    )
