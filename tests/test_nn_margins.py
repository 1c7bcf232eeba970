"""benchmarks/nn_margins.py (the NN@1 margin analysis of the transformer benchmark) against
brute-force loops over hand-made embeddings."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import nn_margins as nm


def _brute_margins(embs):
    e = [np.asarray(x, np.float64).ravel() for x in embs]
    e = [x / np.linalg.norm(x) for x in e]
    nn, marg = [], []
    for i, a in enumerate(e):
        sims = sorted(((float(a @ b), j) for j, b in enumerate(e) if j != i), reverse=True)
        nn.append(sims[0][1])
        marg.append(sims[0][0] - sims[1][0])
    return np.array(nn), np.array(marg)


def _data(n=12, d=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(1, d)).astype(np.float32) for _ in range(n)]


def test_margins_match_brute_force():
    ref = _data()
    nn, m = nm.margins(ref)
    want_nn, want_m = _brute_margins(ref)
    np.testing.assert_array_equal(nn, want_nn)
    np.testing.assert_allclose(m, want_m, rtol=1e-12, atol=1e-12)
    assert np.all(m >= 0)


def test_failures_name_the_flipped_sentence_and_its_margin():
    # 0 is a near-tie between 1 and 2 (margin ~0.0001); 3 is far from both
    ref = [np.array([1.0, 0.0, 0.0]), np.array([1.0, 0.1, 0.0]), np.array([1.0, 0.0, 0.1001]),
           np.array([0.0, 0.0, 1.0])]  # fmt: skip
    test = [ref[0] + np.array([0.0, 0.0, 0.01]), ref[1], ref[2], ref[3]]
    fails = nm.failures(ref, test)
    _, m = _brute_margins(ref)
    assert [i for i, _ in fails] == [0]
    assert fails[0][1] == pytest.approx(m[0])
    assert nm.failures(ref, ref) == []


def test_scaled_error_curve_ends_at_the_test_set():
    ref = _data(seed=1)
    rng = np.random.default_rng(2)
    test = [x + 0.4 * rng.normal(size=x.shape) for x in ref]
    curve = nm.scaled_error_curve(ref, test, ts=(0.0, 1.0))
    assert curve[0][1:] == (1.0, pytest.approx(1.0))
    nn_ref, _ = _brute_margins(ref)
    nn_test, _ = _brute_margins(test)
    u = [x.ravel() / np.linalg.norm(x) for x in ref]
    v = [x.ravel() / np.linalg.norm(x) for x in test]
    assert curve[1][1] == pytest.approx(np.mean(nn_ref == nn_test))
    assert curve[1][2] == pytest.approx(np.mean([a @ b for a, b in zip(u, v, strict=True)]))


def test_isotropic_errors_keep_each_sentence_s_error_size():
    ref = _data(seed=3)
    test = [x * 1.0 for x in ref]  # no error: every draw agrees
    assert np.all(nm.isotropic_nn(ref, test, draws=5) == 1.0)
    rng = np.random.default_rng(4)
    noisy = [x + 0.3 * rng.normal(size=x.shape) for x in ref]
    iso = nm.isotropic_nn(noisy, noisy, draws=3)
    assert np.all(iso == 1.0)
    big = [x + 5.0 * rng.normal(size=x.shape) for x in ref]
    assert nm.isotropic_nn(ref, big, draws=20).mean() < 1.0


def test_subspace_fraction_of_errors_inside_and_outside_the_pcs():
    rng = np.random.default_rng(5)
    ref = [np.concatenate([rng.normal(size=2), [0.0, 0.0]]) + np.array([0, 0, 3.0, 0])
           for _ in range(10)]  # fmt: skip
    # sentences differ only in dims 0-1: an error along dim 3 is outside the top-2 PCs
    out = [r / np.linalg.norm(r) + np.array([0, 0, 0, 0.01]) for r in ref]
    assert nm.subspace_fraction(ref, out, 2) < 1e-4  # (renormalizing tilts it a hair)
    assert nm.subspace_fraction(ref, out, 4) == pytest.approx(1.0)
