"""Error statistics of a quantized tensor against its fp32 reference (streaming).

:class:`ErrorStats` accumulates float64 sums over any number of arrays, so nothing is kept
per sample; SQNR = ``10 log10(sum(ref^2) / sum((ref - q)^2))`` and cosine over all elements:

    >>> import numpy as np
    >>> e = ErrorStats()
    >>> e.add(np.array([1.0, 2.0]), np.array([1.0, 2.1]))
    >>> round(e.sqnr, 2), round(e.cos, 5)
    (26.99, 0.99994)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autoq import primitives as P
from autoq.qparams import QParam

__all__ = ["ErrorStats", "fake_quant", "output_sums", "sqnr_db", "sqnr_of_sums"]


class ErrorStats:
    """Streaming SQNR / cosine of ``q`` against ``ref`` (float64 sums)."""

    __slots__ = ("dot", "err2", "n", "q2", "ref2")

    def __init__(self):
        self.n = 0
        self.ref2 = self.err2 = self.q2 = self.dot = 0.0

    @staticmethod
    def sums(ref, q) -> tuple[int, float, float, float, float]:
        """What one :meth:`add` adds: ``(n, sum ref^2, sum (ref - q)^2, sum q^2, sum ref*q)``
        (plain numbers: a worker of a distributed analysis sends them, and the coordinator
        adds them in sample order with :meth:`add_sums`, the same float additions as here)."""
        r = np.asarray(ref, np.float64).ravel()
        t = np.asarray(q, np.float64).ravel()
        d = r - t
        return r.size, float(r @ r), float(d @ d), float(t @ t), float(r @ t)

    def add(self, ref, q) -> None:
        self.add_sums(*self.sums(ref, q))

    def add_sums(self, n: int, ref2: float, err2: float, q2: float, dot: float) -> None:
        self.n += n
        self.ref2 += ref2
        self.err2 += err2
        self.q2 += q2
        self.dot += dot

    @property
    def sqnr(self) -> float:
        if self.n == 0:
            return float("nan")
        if self.err2 == 0.0:
            return float("inf")
        if self.ref2 == 0.0:
            return float("-inf")
        return 10.0 * math.log10(self.ref2 / self.err2)

    @property
    def cos(self) -> float:
        if self.n == 0:
            return float("nan")
        if self.ref2 == 0.0 or self.q2 == 0.0:
            return 1.0 if self.ref2 == self.q2 else 0.0
        return self.dot / math.sqrt(self.ref2 * self.q2)


def sqnr_db(ref: Sequence, test: Sequence) -> float:
    """SQNR in dB of ``test`` against ``ref`` (sequences of arrays or lists of arrays)."""
    return sqnr_of_sums(output_sums(ref, test))


def output_sums(ref: Sequence, test: Sequence) -> list[list[tuple]]:
    """Per sample, the :meth:`ErrorStats.sums` of each output of ``test`` against ``ref``
    (what :func:`sqnr_db` adds up; a worker of a distributed search sends them)."""
    return [
        [ErrorStats.sums(a, b) for a, b in zip(_flat_outputs(r), _flat_outputs(t), strict=True)]
        for r, t in zip(ref, test, strict=True)
    ]


def sqnr_of_sums(per_sample: Sequence[Sequence[tuple]]) -> float:
    """The SQNR (dB) of :func:`output_sums`, added in the order given."""
    e = ErrorStats()
    for sums in per_sample:
        for s in sums:
            e.add_sums(*s)
    return e.sqnr


def _flat_outputs(o) -> list:
    return list(o) if isinstance(o, list | tuple) else [o]


def fake_quant(x: np.ndarray, qp: QParam):
    """(dequantized values, number clipped) for ``x`` quantized with ``qp`` (bit-exact with
    :func:`autoq.primitives.quantize` / ``dequantize``)."""
    qmin, qmax = P.qrange(qp.dtype)
    x = np.asarray(x, np.float32)
    if qp.axis is not None and qp.scale.ndim == 1:
        shape = [1] * x.ndim
        shape[qp.axis] = -1
        s = qp.scale.reshape(shape)
        z = qp.zero_point.reshape(shape).astype(np.float32)
    else:
        s = np.float32(qp.scale.reshape(-1)[0])
        z = np.float32(qp.zero_point.reshape(-1)[0])
    v = np.rint(x / s) + z
    clipped = int(np.count_nonzero((v < qmin) | (v > qmax)))
    v = np.clip(v, qmin, qmax)
    return ((v - z) * s).astype(np.float32), clipped
