"""``kl``: the entropy calibration of TensorRT (NVIDIA pytorch-quantization's algorithm).

Options: ``bins`` (default 2048). The histogram ``h`` of ``|x|`` over ``[0, max|x|]``
(:mod:`._histogram`, ``needs_range``), and ``L = 2**(bits - 1)`` quantized levels for the
spec's dtype (128 for int8 and uint8, 32768 for int16). As NVIDIA does, the first bin (the
zeros of ReLU outputs) is first replaced by the second: ``h[0] = h[1]``. Then for every
candidate ``i = L .. bins`` (keep bins ``0 .. i-1``):

* reference ``p = h[:i]`` with the outliers ``sum(h[i:])`` folded into ``p[i-1]``;
* candidate ``q``: ``h[:i]`` (without the outliers) merged into ``L`` levels (bin ``j`` goes
  to level ``floor(j * L / i)``), each level's mass spread evenly over the bins of that level
  that are non-zero in ``h``, and zero on the others;
* ``KL(p || q)`` of the normalized distributions, as ``scipy.stats.entropy`` computes it
  (infinite when ``p > 0`` where ``q = 0``: the outliers fold onto an empty bin).

The threshold ``T`` is the upper edge of bin ``i - 1`` for the ``i`` of least divergence;
ties (equal up to 1e-9, i.e. float noise) go to the largest ``i``, as NVIDIA's "last argmin".
The range is ``[-T, T]``; for an asymmetric spec and data of one sign it is ``[0, T]`` (or
``[-T, 0]``). With ``L >= bins`` nothing can be gained by clipping and ``T = max|x|``.
Per-channel works channel by channel.

Vectorized: with prefix sums of ``h``, of ``h > 0`` and of ``h log h``, every candidate's
divergence is ``(sum p log p - sum p log q) / N + log(sum h[:i] / N)``; ``sum p log q`` is a
sum over the ``L`` levels of ``S log(S / n)`` (level mass ``S``, non-zero bins ``n``), and
the levels' bin boundaries ``ceil(k * i / L)`` for all candidates at once form one
``(bins - L + 1, L + 1)`` integer array. No loop over candidates.

**Use it with ``calibration="fp32"``.** The algorithm assumes a continuous distribution. In
``topological`` mode a tensor's values carry the upstream quantization: they sit on a grid
(multiples of the upstream scales), and a 2048-bin histogram of them is a comb of spikes and
near-empty bins. Spreading each level's mass evenly over the non-zero bins then matches the
comb so badly for every wide candidate that the narrowest one (``i = L``) wins: on ResNet-50
with 64 samples a residual add got ``T = 1.09`` for data spanning [-8.7, 17.2], and the
model's output was destroyed (cosine 0.24). ``percentile`` and ``mse`` do not have this
problem (mse is the default).

Differences: NVIDIA grows its histogram when a later batch exceeds the range (order
dependent); here the range is fixed. ONNX Runtime's "entropy" uses a signed histogram with
128 bins by default (one candidate: the max range), truncates q to integers and is much
slower. NVIDIA uses 256 levels for unsigned quantizers; here ``L`` follows the dtype's bits.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from autoq.primitives import qrange

from . import register
from ._histogram import HistogramCalibrator, HistogramObserver

TIE = 1e-9


BLOCK = 256  # candidates per vectorized block (keeps the (block, L) temporaries in cache)


def kl_divergences(hist: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidates ``i = levels .. len(hist)`` and ``KL(p_i || q_i)`` for each (see above)."""
    h = np.asarray(hist, np.float64).copy()
    n = h.size
    if n > 1:
        h[0] = h[1]
    xlogx = h * np.log(h, where=h > 0, out=np.zeros(n))
    cum_h = np.concatenate(([0.0], np.cumsum(h)))
    cum_nz = np.concatenate(([0.0], np.cumsum(h > 0, dtype=np.float64)))
    cum_xlogx = np.concatenate(([0.0], np.cumsum(xlogx)))
    total = cum_h[-1]
    k = np.arange(levels + 1)
    candidates = np.arange(levels, n + 1)
    kl = np.empty(candidates.size)
    for b in range(0, candidates.size, BLOCK):
        i = candidates[b : b + BLOCK]
        # level k holds bins ceil(k*i/L) .. ceil((k+1)*i/L) - 1 (bin j -> floor(j*L/i))
        bounds = -((-k[None, :] * i[:, None]) // levels)
        mass = np.diff(cum_h[bounds], axis=1)
        nonzero = np.diff(cum_nz[bounds], axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_level = mass * np.log(mass / nonzero)  # NaN where the level is empty
            p_log_q = np.nansum(per_level, axis=1)
            outliers = total - cum_h[i]
            last = h[i - 1]
            q_last = mass[:, -1] / nonzero[:, -1]
            p_log_q += np.where(outliers > 0, outliers * np.log(q_last), 0.0)
            p_last = last + outliers
            p_log_p = cum_xlogx[i - 1] + np.where(p_last > 0, p_last * np.log(p_last), 0.0)
            kl[b : b + BLOCK] = (p_log_p - p_log_q) / total + np.log(cum_h[i] / total)
        kl[b : b + BLOCK][(outliers > 0) & (last == 0)] = np.inf
    return candidates, kl


def kl_threshold_bins(hist: np.ndarray, levels: int) -> int:
    """How many bins to keep: the ``i`` of least divergence (ties -> the largest ``i``)."""
    n = len(hist)
    if levels >= n or not np.any(hist):
        return n
    i, kl = kl_divergences(hist, levels)
    best = np.flatnonzero(kl <= kl.min() + TIE)
    return int(i[best[-1]])


@register("kl")
class KL(HistogramCalibrator):
    """Entropy (KL divergence) calibration (see the module docstring)."""

    kinds: ClassVar[tuple[str, ...]] = ("abs",)

    def choose_range(self, obs: HistogramObserver, spec) -> tuple[np.ndarray, np.ndarray]:
        qmin, qmax = qrange(spec.dtype)
        levels = 2 ** ((qmax - qmin + 1).bit_length() - 2)  # 2**(bits-1)
        counts, edges = obs.counts["abs"], obs.edges["abs"]
        _, amax = obs.bounds("abs")
        t = np.array([edges[c, kl_threshold_bins(counts[c], levels)] for c in range(obs.channels)])
        t = np.where(amax == 0, 0.0, t)
        if spec.symmetric:
            return -t, t
        return np.where(obs.lo < 0, -t, 0.0), np.where(obs.hi > 0, t, 0.0)
