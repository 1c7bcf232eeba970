"""How far an embedding set's nearest-neighbour agreement (NN@1) can be trusted.

NN@1 (``common.fidelity("embedding", ...)``) counts the sentences whose most similar other
sentence is the same as in fp32. A sentence whose two closest neighbours are nearly tied in
fp32 (a small *margin*, the cosine of the nearest minus that of the second nearest) flips on
any perturbation, so the score of a set depends on how many near-ties it has as much as on
the quantization. These helpers measure that (numpy only, fp32 reference embeddings ``ref``
and the embeddings under test ``test``, one array per sentence):

* :func:`margins`: each sentence's fp32 nearest neighbour and its margin;
* :func:`failures`: the sentences whose nearest neighbour changed, with their fp32 margins;
* :func:`scaled_error_curve`: NN@1 and mean cosine with the test error scaled by ``t``
  (``normalize(ref + t * (test - ref))``): how small the *same* error must get for a score;
* :func:`isotropic_nn`: NN@1 over random errors of the same per-sentence size in random
  directions (tangent to the unit sphere): what the error's size alone predicts;
* :func:`subspace_fraction`: the share of the error energy in the top principal components of
  the fp32 embeddings (the directions in which sentences differ; isotropic: ``k / dim``).

Used by ``benchmarks/transformer_int16.py --margins``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def unit_rows(outs: Sequence[np.ndarray]) -> np.ndarray:
    """The outputs as rows of a float64 matrix, each scaled to unit length."""
    e = np.concatenate([np.asarray(x, np.float64).reshape(1, -1) for x in outs])
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def _sims(e: np.ndarray) -> np.ndarray:
    s = e @ e.T
    np.fill_diagonal(s, -np.inf)
    return s


def nearest(e: np.ndarray) -> np.ndarray:
    """Each row's most similar other row (cosine; ``e`` rows of unit length)."""
    return _sims(e).argmax(axis=1)


def margins(ref: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(nearest neighbour, margin) per sentence in fp32: margin = cosine to the nearest minus
    cosine to the second nearest (>= 0)."""
    s = _sims(unit_rows(ref))
    top2 = np.argsort(-s, axis=1)[:, :2]
    rows = np.arange(len(s))
    return top2[:, 0], s[rows, top2[:, 0]] - s[rows, top2[:, 1]]


def failures(ref, test) -> list[tuple[int, float]]:
    """(sentence, its fp32 margin) for every sentence whose nearest neighbour changed."""
    nn, m = margins(ref)
    got = nearest(unit_rows(test))
    return [(int(i), float(m[i])) for i in np.flatnonzero(got != nn)]


def _score(r: np.ndarray, e: np.ndarray, nn_ref: np.ndarray) -> tuple[float, float]:
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    return float(np.mean(nearest(e) == nn_ref)), float(np.mean(np.sum(r * e, axis=1)))


def scaled_error_curve(ref, test, ts=(0.25, 0.5, 0.75, 1.0)) -> list[tuple[float, float, float]]:
    """(t, NN@1, mean cosine) of ``normalize(ref + t * (test - ref))`` for each ``t``."""
    r, q = unit_rows(ref), unit_rows(test)
    nn_ref = nearest(r)
    return [(float(t), *_score(r, r + t * (q - r), nn_ref)) for t in ts]


def isotropic_nn(ref, test, draws: int = 200, seed: int = 0) -> np.ndarray:
    """NN@1 of ``draws`` random error sets: sentence ``i`` moved by a random direction
    tangent to the sphere at its fp32 embedding, with the length of its test error."""
    r, q = unit_rows(ref), unit_rows(test)
    size = np.linalg.norm(q - r, axis=1)
    nn_ref, rng = nearest(r), np.random.default_rng(seed)
    out = np.empty(draws)
    for k in range(draws):
        n = rng.standard_normal(r.shape)
        n -= np.sum(n * r, axis=1, keepdims=True) * r
        n *= (size / np.maximum(np.linalg.norm(n, axis=1), 1e-30))[:, None]
        out[k] = _score(r, r + n, nn_ref)[0]
    return out


def subspace_fraction(ref, test, k: int) -> float:
    """Share of the error energy ``sum ||test - ref||^2`` (unit rows) in the top ``k``
    principal components of the fp32 embeddings."""
    r, q = unit_rows(ref), unit_rows(test)
    c = r - r.mean(axis=0)
    _, _, vt = np.linalg.svd(c, full_matrices=False)
    d = q - r
    return float(np.sum((d @ vt[:k].T) ** 2) / np.sum(d**2))


def summary(ref, test) -> list[str]:
    """Log lines: the failing sentences with their margins, the scaled-error curve, the
    isotropic prediction and the error's share in the embedding subspace."""
    _, m = margins(ref)
    fails = failures(ref, test)
    lines = [
        "    fp32 margins: "
        + ", ".join(f"{int(np.sum(m < x))} < {x:g}" for x in (0.005, 0.01, 0.02))
        + f" of {len(m)}; failing (sentence, fp32 margin): "
        + ", ".join(f"({i}, {v:.4f})" for i, v in fails),
        "    same error scaled by t (t, NN@1, cos): "
        + ", ".join(f"({t:g}, {a:.1%}, {c:.5f})" for t, a, c in scaled_error_curve(ref, test)),
    ]
    iso = isotropic_nn(ref, test)
    lines.append(
        f"    isotropic error of the same sizes: NN@1 mean {iso.mean():.1%} "
        f"(p10 {np.percentile(iso, 10):.1%}, p90 {np.percentile(iso, 90):.1%}); "
        + "error energy in the top 8/32 fp32 PCs: "
        + " / ".join(f"{subspace_fraction(ref, test, k):.3f}" for k in (8, 32))
        + f" (isotropic {8 / unit_rows(ref).shape[1]:.3f} / {32 / unit_rows(ref).shape[1]:.3f})"
    )
    return lines
