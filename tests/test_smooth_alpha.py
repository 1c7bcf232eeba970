"""Per-LayerNorm SmoothQuant alpha search (autoq.smooth_alpha, Config.smooth_quant_alphas):
the group error against a plain numpy quantize/dequantize, the search's choice, the option's
validation, and on the tiny LN block the rewritten model computes the same function, the
realized module equals its simulated graph, and the searched alphas quantize it at least as
well as the fixed default."""

from __future__ import annotations

import numpy as np
import pytest

import autoq
from autoq import Config, QuantSpec
from autoq.calibrate import samples_for
from autoq.fidelity import compare
from autoq.metrics import sqnr_db
from autoq.simulate import simulate
from autoq.smooth_alpha import group_error, search_alpha
from autoq.smoothing import smoothing_scales
from models import TARGET, Runner, ln_block, small_cnn
from models import ln_block_data as data

ACT = QuantSpec(dtype="int8", symmetric=False, calibrator="max")
WEIGHT = QuantSpec(dtype="int8", symmetric=True, narrow_range=True, per_channel=True)
GRID = (0.2, 0.35, 0.5, 0.65, 0.8)


def _np_error(x, weights, s):
    """The group error with the quantizers written out (asymmetric min/max per tensor for
    the activation, symmetric narrow per column for the weights)."""
    xs = (x / s).astype(np.float32)
    lo, hi = min(float(xs.min()), 0.0), max(float(xs.max()), 0.0)
    scale = np.float32((hi - lo) / 255.0)
    zp = np.float32(np.clip(np.rint(-128 - lo / scale), -128, 127))
    xq = (np.clip(np.rint(xs / scale) + zp, -128, 127) - zp) * scale
    total = 0.0
    for w in weights:
        ws = (w * s[:, None]).astype(np.float32)
        ws_scale = (np.abs(ws).max(axis=0) / 127.0).astype(np.float32)
        wq = np.clip(np.rint(ws / ws_scale), -127, 127) * ws_scale
        ref = x.astype(np.float64) @ w.astype(np.float64)
        d = xq.astype(np.float64) @ wq.astype(np.float64) - ref
        total += np.sum(d * d) / np.sum(ref * ref)
    return total


def _outlier_case(seed=0, outlier=30.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(256, 24)).astype(np.float32)
    x[:, 3] *= outlier  # one outlier channel, as LayerNorm outputs of BERT have
    ws = [rng.normal(size=(24, n)).astype(np.float32) * 0.1 for n in (16, 8)]
    return x, ws


def test_group_error_matches_numpy():
    x, ws = _outlier_case()
    amax = np.abs(x).max(axis=0)
    wmax = np.max([np.abs(w).max(axis=1) for w in ws], axis=0)
    for alpha in (0.3, 0.5, 0.8):
        s = smoothing_scales(amax, wmax, alpha)
        got = group_error(x, ws, s, ACT, WEIGHT)
        assert got == pytest.approx(_np_error(x, ws, s), rel=1e-4)


def test_search_picks_the_smallest_error_and_beats_no_smoothing():
    x, ws = _outlier_case()
    amax = np.abs(x).max(axis=0)
    alpha, s, errors = search_alpha(x, amax, ws, GRID, ACT, WEIGHT)
    assert set(errors) == set(GRID) and errors[alpha] == min(errors.values())
    wmax = np.max([np.abs(w).max(axis=1) for w in ws], axis=0)
    np.testing.assert_array_equal(s, smoothing_scales(amax, wmax, alpha))
    # no migration (s = 1): the outlier channel takes the int8 grid from the others
    assert errors[alpha] < 0.5 * group_error(x, ws, np.ones(24), ACT, WEIGHT)
    with pytest.raises(ValueError, match="at least one alpha"):
        search_alpha(x, amax, ws, (), ACT, WEIGHT)


def test_option_is_validated_and_round_trips():
    cfg = Config(smooth_quant_alphas=(0.3, 0.5, 0.7))
    assert Config.loads(cfg.dumps()) == cfg
    assert Config.from_json(Config().to_json()).smooth_quant_alphas == ()
    for bad, err in (((0.0,), ValueError), ((1.0,), ValueError), ((True,), ValueError),
                     ((0.5, 0.5), ValueError), ([0.5], TypeError)):  # fmt: skip
        with pytest.raises(err, match="smooth_quant_alphas"):
            Config(smooth_quant_alphas=bad)
    with pytest.raises(ValueError, match=r"smooth_quant_alphas.*needs Config\.smooth_quant"):
        Config(smooth_quant=None, smooth_quant_alphas=(0.5,))


def test_searched_alphas_on_the_ln_block():
    mod, params, _ = ln_block()
    ref = Runner(mod, params)
    held = data(6, 9)
    fp32 = [ref(x) for x in held]
    got = {}
    for grid in ((), GRID):
        cfg = Config(progress=False, check_scales=False, smooth_quant_alphas=grid)
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, data(8, 1))
        run = Runner(res.module)
        got[grid] = (sqnr_db(fp32, [run(x) for x in held]), res)
    base, res = got[()][1], got[GRID][1]
    assert set(base.smooth_alphas.values()) == {0.5}
    assert set(res.smooth_alphas) == set(res.smoothed) and len(res.smoothed) == 2
    assert all(a in GRID for a in res.smooth_alphas.values())
    # the rewritten float model computes the same function; the module equals its simulation
    smoothed = Runner(*_float_model(res))
    for x, r in zip(held, fp32, strict=True):
        np.testing.assert_allclose(smoothed(x), r, rtol=1e-4, atol=1e-5 * np.abs(r).max())
    sim = simulate(res.matched, None, res.config)
    rep = compare(sim, res.module, res.qparams, samples_for(held[:2], sim.graph.inputs), TARGET)
    assert rep.exact, rep.table()
    assert got[GRID][0] >= got[()][0] - 0.5, {k: v[0] for k, v in got.items()}


def _float_model(res):
    g = res.matched.graph
    return g.module, g.params


def test_a_cnn_is_untouched_by_the_search():
    """No LayerNorm feeds a dense layer: the very qparams of the default config."""
    mod, params, make = small_cnn()
    got = []
    for grid in ((), GRID):
        res = autoq.Quantizer(Config(progress=False, smooth_quant_alphas=grid), target=TARGET).run(
            mod, params, make(4)
        )
        assert res.smoothed == () and res.smooth_alphas == {}
        qp = res.qparams
        got.append({s: (qp[s].scale.tobytes(), qp[s].zero_point.tobytes()) for s in qp.params})
    assert got[0] == got[1]
