"""``percentile``: clip the rarest ``100 - percentile`` percent of the values.

Options: ``percentile`` (default 99.99, in [50, 100]) and ``bins`` (default 2048). Built on
the fixed-range histograms of :mod:`._histogram` (``needs_range``), which keep both kinds
because the spec (symmetric or not) is only known at ``compute``:

* symmetric spec: the histogram of ``|x|`` over ``[0, max|x|]``; ``T`` is the upper edge of
  the first bin at which the cumulative count reaches ``percentile`` % of the total; the
  range is ``[-T, T]`` (ONNX Runtime's and NVIDIA's method);
* asymmetric spec: the signed histogram over ``[lo, hi]``; the upper bound is found as above,
  the lower bound mirror-wise (the lower edge of the last bin whose count *from the top*
  reaches ``percentile`` %), i.e. the ``100 - p`` and ``p`` percentiles: at most
  ``100 - p`` % of the values are clipped on each side.

Per-channel (``axis``) works the same way, one histogram per channel.

Differences from the peers: ONNX Runtime and NVIDIA take the *lower* edge of the bin that
crosses the percentile; the upper edge is used here, so that ``percentile=100`` is exactly
the ``max`` range and a constant tensor is not clipped. ONNX Runtime's asymmetric mode cuts
``(100 - p) / 2`` % on each side; here each side is cut at ``100 - p`` % (the ``100 - p`` and
``p`` percentiles). NVIDIA's default is 99.99 (this one's), ONNX Runtime's 99.999.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import register
from ._histogram import HistogramMethod, HistogramObserver


def upper_bin(counts: np.ndarray, fraction: float) -> np.ndarray:
    """Per row, the first bin at which the cumulative count reaches ``fraction`` of the total."""
    cum = np.cumsum(counts, axis=1)
    target = fraction * cum[:, -1:]
    return np.minimum((cum < target).sum(axis=1), counts.shape[1] - 1)


@register("percentile")
@dataclass(frozen=True)
class Percentile(HistogramMethod):
    """Histogram percentile (see the module docstring)."""

    percentile: float = 99.99
    bins: int = 2048
    kinds: ClassVar[tuple[str, ...]] = ("abs", "signed")

    def __post_init__(self) -> None:
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, int | float) or not 50 <= p <= 100:
            raise ValueError(f"Percentile.percentile must be a number in [50, 100], got {p!r}")
        object.__setattr__(self, "percentile", float(p))
        super().__post_init__()

    def choose_range(self, obs: HistogramObserver, spec) -> tuple[np.ndarray, np.ndarray]:
        q = self.percentile / 100.0
        rows = np.arange(obs.channels)
        if spec.symmetric:
            _, amax = obs.bounds("abs")
            t = obs.edges["abs"][rows, upper_bin(obs.counts["abs"], q) + 1]
            t = np.where(amax == 0, 0.0, t)
            return -t, t
        counts, edges = obs.counts["signed"], obs.edges["signed"]
        rmax = edges[rows, upper_bin(counts, q) + 1]
        rmin = edges[rows, self.bins - 1 - upper_bin(counts[:, ::-1], q)]
        same = obs.lo == obs.hi
        return np.where(same, obs.lo, rmin), np.where(same, obs.hi, rmax)
