"""SmoothQuant (autoq.accuracy.smoothing, autoq.accuracy.smooth_quant): the rewritten float model computes the
same function, the LayerNorm outputs lose their outlier channel, and the quantized model is
closer to fp32 with it than without, on a tiny post-LN + pre-LN transformer block."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import autoq
from autoq import Config
from autoq.accuracy.smooth_quant import find_smoothable, smooth_graph
from autoq.accuracy.smoothing import smoothing_scales
from autoq.calibration import samples_for
from autoq.errors import InputError
from autoq.fallback.fidelity import compare
from autoq.ir.matching import match
from autoq.ir.toolkit import bindings, op_name
from autoq.metrics import sqnr_db
from autoq.simulation import simulate
from models import LN_OUTLIER as OUTLIER
from models import TARGET, Runner, ln_block, small_cnn
from models import ln_block_data as data


def block():
    mod, params, _ = ln_block()
    return mod, params


def test_scales_follow_the_paper():
    s = smoothing_scales(np.array([16.0, 1.0]), np.array([1.0, 4.0]), alpha=0.5)
    assert np.allclose(s, [4.0, 0.5])
    s = smoothing_scales(np.array([16.0]), np.array([4.0]), alpha=0.75)
    assert np.allclose(s, [16.0**0.75 / 4.0**0.25])
    for bad in (0, 1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="smooth_quant"):
            Config(recipe="cnn", smooth_quant=bad)
    with pytest.raises(ValueError, match="smooth_quant"):
        Config(recipe="cnn", smooth_quant=1.0)
    cfg = Config(recipe="cnn", smooth_quant=0.6)
    assert Config.loads(cfg.dumps()) == cfg


@pytest.fixture(scope="module")
def smoothed():
    mod, params = block()
    g = match(mod, params, Config(recipe="cnn")).graph
    samples = samples_for(data(8, 1), g.inputs)
    new_mod, new_params, plans = smooth_graph(g, samples, 0.5, TARGET)
    return mod, params, g, new_mod, new_params, plans


def test_finds_both_layer_norms(smoothed):
    _, _, g, _, _, plans = smoothed
    assert len(plans) == 2
    post, pre = plans
    assert len(post.matmuls) == 1 and len(post.others) == 1  # the residual add
    assert op_of(g, post.others[0]) == "relax.add"
    assert len(pre.matmuls) == 1 and pre.others == []
    assert all(p.scale[OUTLIER] > 3 * np.median(p.scale) for p in plans)


def op_of(g, var):
    return op_name(g.value[var])


def test_float_function_is_preserved(smoothed):
    mod, params, g, new_mod, new_params, _ = smoothed
    before, after = Runner(mod, params), Runner(new_mod, new_params)
    for x in data(4, 7):
        ref = before(x)
        np.testing.assert_allclose(after(x), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())

    # LN1 has a residual reader: a second, smoothed LayerNorm feeds its dense layer; LN2
    # (only read by a dense layer) is rewritten in place
    def layer_norms(pairs):
        return [op_name(v) for _, v in pairs].count("relax.nn.layer_norm")

    assert layer_norms(bindings(new_mod["main"])) == layer_norms(g.bindings) + 1


def test_layer_norm_outputs_lose_the_outlier(smoothed):
    _, _, g, new_mod, new_params, plans = smoothed
    g2 = match(new_mod, new_params, Config(recipe="cnn")).graph
    samples = samples_for(data(8, 1), g2.inputs)
    from autoq.accuracy.smooth_quant import activation_maxima

    before = activation_maxima(g, plans, samples, TARGET)
    after = activation_maxima(g2, find_smoothable(g2), samples, TARGET)
    for b, a in zip(before, after, strict=True):
        # the per-tensor range is set by the outlier channel: it shrinks several times,
        # the ordinary channels' share of the int8 grid grows with it
        assert a.max() < b.max() / 3
        assert np.median(a) / a.max() > 3 * np.median(b) / b.max()


def test_quantized_model_is_closer_to_fp32():
    mod, params = block()
    ref = Runner(mod, params)
    held = data(6, 9)
    fp32 = [ref(x) for x in held]
    sqnr = {}
    for alpha in (None, 0.5):
        cfg = Config(recipe="cnn", check_scales=False, smooth_quant=alpha)
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, data(8, 1))
        run = Runner(res.module)
        sqnr[alpha] = sqnr_db(fp32, [run(x) for x in held])
    assert len(res.smoothed) == 2, res.smoothed
    # the realized module is the rewritten model's: it equals *that* simulated graph
    sim = simulate(res.matched, None, res.config)
    rep = compare(sim, res.module, res.qparams, samples_for(held[:2], sim.graph.inputs), TARGET)
    assert rep.exact, rep.table()
    assert sqnr[0.5] > sqnr[None] + 8.0, sqnr  # measured 7.9 -> 21.3 dB
    # check_scales: the qparams belong to the rewritten model, not to the input one
    autoq.check_scales(res.matched, None, res.qparams, held, cfg, TARGET)
    with pytest.raises(InputError, match=r"QuantizeResult\.matched"):
        autoq.check_scales(mod, params, res.qparams, held, cfg, TARGET)


def test_a_model_without_layer_norms_is_unchanged():
    """A CNN: nothing to smooth, no warning, the very qparams of smooth_quant=None."""
    mod, params, make = small_cnn()
    got = {}
    for alpha in (None, 0.5):
        cfg = Config(recipe="cnn", smooth_quant=alpha)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, make(4))
        assert res.smoothed == ()
        qp = res.qparams
        got[alpha] = {
            s: (qp[s].dtype, qp[s].scale.tobytes(), qp[s].zero_point.tobytes()) for s in qp.params
        }
    assert got[None] == got[0.5]
