"""autoq.accuracy.gptq: against round-to-nearest, an independent OBQ-style
reference (explicit inverse downdates, no Cholesky, no blocks) and brute force."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from reference_ops import conv2d_loops

import autoq.accuracy.gptq as G
from autoq.accuracy.gptq import gptq, rtn
from autoq.accuracy.hessian import ConvGeometry, Hessian, flatten_conv_weight, unflatten_conv_weight

QMIN, QMAX = -127, 127


def _correlated(rows=512, k=24, seed=0):
    """Inputs with strongly correlated features (a random mixing of a few factors)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(rows, 6))
    x = z @ rng.normal(size=(6, k)) + 0.1 * rng.normal(size=(rows, k))
    return x


def _max_scales(w):
    amax = np.abs(w.reshape(w.shape[0], -1)).max(axis=1)
    return (amax / 127.0).astype(np.float32)


def _dense_output_mse(x, w, q, scale):
    wq = q * scale.astype(np.float64)[:, None]
    return float(((x @ (w - wq).T) ** 2).mean())


def _obq_reference(w, h, scale, order):
    """Quantize columns in ``order``; after each, the optimal update of the remaining columns
    ``-e * Hinv[i, :] / Hinv[i, i]`` and the downdate of ``Hinv`` removing column i
    (Frantar & Alistarh 2022, OBQ, eqs. 2-3 with the row-wise shared H)."""
    w = w.astype(np.float64).copy()
    hinv = np.linalg.inv(h)
    q = np.zeros(w.shape, np.int64)
    for i in order:
        q[:, i] = np.clip(np.rint(w[:, i].astype(np.float32) / scale), QMIN, QMAX)
        e = (w[:, i] - q[:, i] * scale.astype(np.float64)) / hinv[i, i]
        w -= np.outer(e, hinv[i, :])
        hinv -= np.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]
    return q


def test_doctests():
    for mod in (G,):
        res = doctest.testmod(mod)
        assert res.attempted >= 3 and res.failed == 0


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(act_order):
    x = _correlated()
    w = np.random.default_rng(1).normal(size=(16, x.shape[1]))
    scale = _max_scales(w)
    h = 2 * x.T @ x / len(x)
    w_before = w.copy()
    q = gptq(w, h, scale, act_order=act_order, block_size=8).q
    np.testing.assert_array_equal(w, w_before)  # the caller's weights are not modified
    mse_gptq = _dense_output_mse(x, w, q, scale)
    mse_rtn = _dense_output_mse(x, w, rtn(w, scale), scale)
    assert mse_gptq < 0.3 * mse_rtn, (mse_gptq, mse_rtn)
    assert q.dtype == np.int32 and q.min() >= QMIN and q.max() <= QMAX


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_the_obq_reference(act_order):
    x = _correlated(seed=4, k=12)
    w = np.random.default_rng(5).normal(size=(5, 12))
    scale = _max_scales(w) * 4  # a coarse grid: many columns round far from their value
    h = 2 * x.T @ x / len(x)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(12)
    ref = _obq_reference(w, h, scale, order)
    for block in (1, 5, 128):
        got = gptq(w, h, scale, act_order=act_order, block_size=block, damp=0.0).q
        np.testing.assert_array_equal(got, ref)


def test_diagonal_hessian_is_round_to_nearest_exactly():
    rng = np.random.default_rng(6)
    w = rng.normal(size=(7, 10)).astype(np.float32)
    scale = _max_scales(w)
    for h in (np.eye(10), np.diag(rng.uniform(0.1, 5.0, 10))):
        for act_order in (False, True):
            got = gptq(w, h, scale, act_order=act_order, block_size=3).q
            np.testing.assert_array_equal(got, rtn(w, scale))
    # and RTN is autoq's weight quantization (primitives.quantize with the max scale)
    from autoq import primitives as P

    np.testing.assert_array_equal(rtn(w, scale), P.quantize(w, scale, 0, "int8", axis=0))


def test_dead_inputs_keep_round_to_nearest():
    x = _correlated(k=8)
    x[:, 3] = 0.0
    w = np.random.default_rng(7).normal(size=(4, 8))
    scale = _max_scales(w)
    q = gptq(w, 2 * x.T @ x / len(x), scale).q
    np.testing.assert_array_equal(q[:, 3], rtn(w, scale)[:, 3])


@pytest.mark.parametrize(
    "groups,c,o,k,padding",
    [(1, 4, 6, (3, 3), (1, 1, 1, 1)), (4, 4, 4, (3, 3), (1, 1, 1, 1)), (2, 4, 4, (1, 1), (0,) * 4)],
    ids=["conv", "depthwise", "grouped 1x1"],
)
def test_conv_gptq_lowers_the_output_mse(groups, c, o, k, padding):
    rng = np.random.default_rng(8)
    # spatially smooth inputs: neighbouring taps are correlated, as in images
    # and channels mix two common factors
    base = np.einsum("nfhw,fc->nchw", rng.normal(size=(6, 2, 5, 5)), rng.normal(size=(2, c)))
    x = np.repeat(np.repeat(base, 2, axis=2), 2, axis=3) + 0.05 * rng.normal(size=(6, c, 10, 10))
    geom = ConvGeometry(kernel=k, padding=padding, groups=groups)
    w = rng.normal(size=(o, c // groups, *k))
    scale = _max_scales(w) * 8  # coarse, so that rounding matters
    hess = Hessian.conv2d(geom, c)
    hess.update(x)
    wf = flatten_conv_weight(w, groups)
    q = unflatten_conv_weight(gptq(wf, hess.matrix(), scale).q, w.shape)
    q_rtn = rtn(w.reshape(o, -1), scale).reshape(w.shape)

    def mse(qw):
        dw = w - qw * scale.astype(np.float64).reshape(-1, 1, 1, 1)
        return float((conv2d_loops(x, dw, padding=padding, groups=groups) ** 2).mean())

    assert mse(q) < 0.5 * mse(q_rtn), (mse(q), mse(q_rtn))
    if groups == c:  # depthwise: the batched run equals one problem per channel
        h = hess.matrix()
        for ch in range(c):
            one = gptq(wf[ch], h[ch], scale[ch]).q
            np.testing.assert_array_equal(one, q[ch].reshape(1, -1))


def test_gptq_rejects_bad_shapes():
    with pytest.raises(ValueError, match="h \\(groups, in, in\\)"):
        gptq(np.zeros((2, 3)), np.eye(4), 1.0)
    with pytest.raises(ValueError, match="positive"):
        gptq(np.ones((2, 3)), np.eye(3), 0.0)
