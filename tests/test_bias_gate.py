"""BiasCorrection.holdout (autoq.accuracy.bias_gate): each layer's empirical bias correction is
kept only if it lowers the layer's (post-activation) output error against fp32 on held-out
samples; decisions checked against a numpy recomputation of the rule, the realized module
against the simulation bit for bit."""

from __future__ import annotations

import doctest
import warnings

import numpy as np
import pytest

import autoq.accuracy.bias_gate as G
import autoq.calibration.holdout
from autoq import Config, calibrate, realize, simulate
from autoq import primitives as P
from autoq.accuracy.hessian import ConvGeometry
from autoq.accuracy.weight_tuning import layer_tasks
from autoq.calibration import samples_for
from autoq.config import BiasCorrection
from autoq.fallback.fidelity import compare
from autoq.qparams import QParams
from models import TARGET, conv2d_nchw, mlp, small_cnn, two_convs

EBC = Config(recipe="cnn", weight_rounding="nearest", bias_correction=BiasCorrection())


def test_doctests():
    assert doctest.testmod(G).failed == 0 and doctest.testmod(autoq.calibration.holdout).failed == 0


def test_config_option_round_trips_and_is_validated():
    cfg = EBC.replace(bias_correction=BiasCorrection(holdout=4))
    assert Config.from_json(cfg.to_json()) == cfg and cfg.bias_holdout == 4
    assert Config(recipe="cnn").bias_holdout == 0
    for bad in (-1, True, 1.5, "4"):
        with pytest.raises(ValueError, match=r"BiasCorrection\.holdout must be an int"):
            EBC.replace(bias_correction=BiasCorrection(holdout=bad))


def test_rows_times_weights_are_the_layer_output():
    """sample_rows + layer_output equal a numpy convolution (all positions: an 8x8 image
    has fewer than MAX_ROWS) and a dense layer's matmul."""
    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(1, 3, 8, 8)), rng.normal(size=(4, 3, 3, 3)), rng.normal(size=4)
    rows = G.sample_rows(x, ConvGeometry(kernel=3, padding=1))
    y = G.layer_output(w.reshape(1, 4, -1), rows, b)
    ref = conv2d_nchw(x, w, pad=1) + b[:, None, None]
    np.testing.assert_allclose(y, ref.reshape(4, -1).T, rtol=1e-12, atol=1e-12)
    xd, wd = rng.normal(size=(1, 5, 6)), rng.normal(size=(6, 3))  # (in, out) like LayerTask
    y = G.layer_output(wd.T[None], G.sample_rows(xd, None), np.zeros(3))
    np.testing.assert_allclose(y, xd[0] @ wd, rtol=1e-12)
    assert G.sample_rows(np.zeros((1, 4000, 2)), None).shape == (1, G.MAX_ROWS, 2)


def test_follower_activations_of_the_test_models():
    """relu and clip after a layer are applied by the gate; a residual block's conv (its
    relu reads conv + b + residual) and a final dense layer are measured pre-activation."""
    v = np.array([-1.0, 2.0, 7.0])
    for make, want in (
        (small_cnn, {"stem": "relu", "block.conv1": "relu", "block.conv2": None, "dw": "relu",
                     "fc": None}),
        (mlp, {"fc1": "relu", "fc2": "clip", "fc3": None}),
    ):  # fmt: skip
        mod, params, _ = make()
        sim = simulate(mod, params, EBC)
        got = {}
        for m in sim.matches:
            f = G.follower_activation(sim.graph, m)
            got[m.layer] = None if f is None else {7.0: "relu", 6.0: "clip"}[f(v)[2]]
        assert {k: got[k] for k in want} == want


def test_a_layer_without_held_out_rows_is_dropped():
    d = G.decide(None, None, np.ones(2))
    assert not d.kept and d.rows == 0 and np.isnan(d.error)
    assert not G.decide(np.zeros((0, 2)), np.zeros((0, 2)), np.ones(2)).kept


def _images(n, seed, offset):
    """Smooth 8x8 images around ``offset``; two pixels at -6 and 6 fix every sample's range,
    so held-out samples of another offset are not clipped by the calibrated input scale."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = np.kron(rng.normal(size=(1, 3, 4, 4)), np.ones((1, 1, 2, 2))) + offset
        x = x + 0.1 * rng.normal(size=x.shape)
        x[0, 0, 0, :2] = (-6.0, 6.0)
        out.append(x.astype(np.float32))
    return out


def _reference_c1(sim, params, qp, cal, held):
    """The gate's rule for two_convs' first layer, recomputed in numpy on every position:
    the correction is the calibration mean of conv(x, W) - conv(x~, W_q); kept iff it
    lowers sum((relu(y~ + c) - relu(y))^2) on the held-out samples. Returns (kept, relative
    errors without / with it)."""
    x_slot = next(t.input_slot for ts in layer_tasks(sim).values() for t in ts if t.layer == "c1")
    xq, wq = qp[x_slot], qp["c1.weight"]
    w, b = params["c1.weight"].astype(np.float64), params["c1.bias"].astype(np.float64)
    w_q = P.dequantize(P.quantize(w, wq.scale, wq.zero_point, wq.dtype, 0), wq.scale, 0, axis=0)

    def outs(samples):
        x = np.concatenate(samples).astype(np.float64)
        xt = P.dequantize(P.quantize(x, xq.scale, xq.zero_point, xq.dtype), xq.scale, xq.zero_point)
        return conv2d_nchw(x, w, 1), conv2d_nchw(xt.astype(np.float64), w_q.astype(np.float64), 1)

    y, yt = outs(cal)
    shift = (y - yt).mean(axis=(0, 2, 3))[None, :, None, None]
    y, yt = (v + b[None, :, None, None] for v in outs(held))
    err = [np.sum((np.maximum(yt + c, 0) - np.maximum(y, 0)) ** 2) for c in (0.0, shift)]
    return bool(err[1] < err[0]), np.array(err) / np.sum(np.maximum(y, 0) ** 2)


@pytest.mark.parametrize("held_offset, helps", [(2.0, True), (-2.0, False)])
def test_gate_keeps_a_helpful_correction_and_drops_a_harmful_one(held_offset, helps):
    """Calibrated around +2: held-out samples from the same distribution gain from c1's
    correction, held-out samples around -2 (the weight rounding's mean error flips sign
    with the input mean) lose; the gate decides as the numpy rule does."""
    mod, params, _ = two_convs()
    cal, held = _images(12, 1, 2.0), _images(4, 2, held_offset)
    cfg = EBC.replace(bias_correction=BiasCorrection(holdout=4))
    sim = simulate(mod, params, cfg)
    qp = calibrate(sim, params, cal + held, cfg, target=TARGET)
    assert qp.meta["samples"] == 12
    kept, errors = _reference_c1(sim, params, qp, cal, held)
    assert kept is helps  # the construction
    tuning = qp.meta["weight_tuning"]
    np.testing.assert_allclose(tuning["bias_gate_errors"]["c1"], errors, rtol=1e-5)
    assert ("c1.bias" in qp.values) is helps and ("c1" in tuning["bias_gate_dropped"]) is not helps
    ungated = calibrate(sim, params, cal, EBC, target=TARGET)
    if helps:  # a kept correction is the ungated one (same calibration samples)
        np.testing.assert_array_equal(qp.values["c1.bias"], ungated.values["c1.bias"])
    assert (
        tuning["bias_kept"] + tuning.get("bias_dropped", 0) == 2 and "bias_unmeasured" not in tuning
    )


def test_held_out_count_edge_cases():
    mod, params, _ = two_convs()
    sim = simulate(mod, params, EBC)
    samples = _images(3, 1, 2.0)
    with pytest.raises(ValueError, match=r"BiasCorrection.holdout=3 leaves no calib"):
        calibrate(
            sim,
            params,
            samples,
            EBC.replace(bias_correction=BiasCorrection(holdout=3)),
            target=TARGET,
        )
    qp = calibrate(
        sim, params, samples, EBC.replace(bias_correction=BiasCorrection(holdout=2)), target=TARGET
    )
    assert qp.meta["samples"] == 1  # one calibration sample is enough
    fp32 = EBC.replace(calibration="fp32", bias_correction=BiasCorrection(holdout=2))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        qp = calibrate(simulate(mod, params, fp32), params, samples, fp32, target=TARGET)
    assert qp.meta["samples"] == 3 and any("topological" in str(x.message) for x in w)


def test_realized_module_equals_the_simulation_with_the_gate_on():
    mod, params, data = small_cnn()
    cfg = EBC.replace(weight_rounding="gptq", bias_correction=BiasCorrection(holdout=3))
    sim = simulate(mod, params, cfg)
    qp = QParams.loads(calibrate(sim, params, data(10, 1), cfg, target=TARGET).dumps())
    tuning = qp.meta["weight_tuning"]
    assert tuning["bias_kept"] + tuning.get("bias_dropped", 0) == 5, tuning
    real = realize(mod, params, qp, cfg)
    test = samples_for(data(3, 7), sim.graph.inputs)
    rep = compare(sim, real, qp, test, target=TARGET)
    assert rep.exact, rep.table()
