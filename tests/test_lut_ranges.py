"""Lookup-table inputs cut where the activation is flat (``autoq/lut_ranges.py``,
``Config.lut_input_ranges``): which slots qualify, the cut qparams against numpy, the
realized graph equal to the simulated one, and a lower error against the fp32 model
(numpy) than the uncut calibration."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config, realize, simulate
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from autoq.ir.canonicalize import hardswish
from autoq.rules.lut_ranges import cut, flat_interval, lut_input_bounds
from models import TARGET, Builder, Runner, conv2d_nchw


def _hardswish(x):
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


def conv_hswish_conv(residual=False):
    """conv 3x3 (weights x3: a wide, symmetric output) -> hardswish -> conv 1x1
    (``residual``: the conv output also added to the result, a second reader)."""
    b = Builder(11)
    x = b.input("x", (1, 3, 8, 8))

    def body(b):
        w1 = b.weight("c1.weight", b.rng.normal(size=(6, 3, 3, 3)) * 1.5)
        y = b.emit(relax.op.nn.conv2d(x, w1, padding=1))
        h = b.emit(hardswish(y))
        out = b.emit(relax.op.nn.conv2d(h, b.randw("c2.weight", (6, 6, 1, 1))))
        return b.emit(relax.op.add(out, y)) if residual else out

    mod, params = b.build(body)
    rng = np.random.default_rng(3)
    data = [rng.normal(size=(1, 3, 8, 8)).astype(np.float32) for _ in range(8)]
    return mod, params, data


def numpy_model(params, x):
    y = conv2d_nchw(x.astype(np.float64), params["c1.weight"].astype(np.float64), pad=1)
    return conv2d_nchw(_hardswish(y), params["c2.weight"].astype(np.float64))


def test_flat_intervals_are_flat():
    """Beyond each interval the activation is within 5e-8 of its value at the end (numpy)."""
    from autoq.ir.activations import ACTIVATIONS

    for act in ACTIVATIONS.values():
        lo, hi = flat_interval(act.name)
        for end, far in ((lo, -1e4), (hi, 1e4)):
            if end is None:
                continue
            xs = np.linspace(end, far, 2001)
            assert np.abs(act.f(xs) - act.f(np.array([end]))).max() < 5e-8, (act.name, end)


def test_only_slots_read_only_by_lookups_are_cut():
    mod, params, _ = conv_hswish_conv()
    sim = simulate(mod, params, Config(recipe="cnn"))
    assert lut_input_bounds(sim) == {"c1": (-3.0, None)}
    mod, params, _ = conv_hswish_conv(residual=True)
    assert lut_input_bounds(simulate(mod, params, Config(recipe="cnn"))) == {}


def test_cut_requantizes_the_range_with_numpy():
    """[-8, 8] cut at -3: scale 11 / 255, zero point round(-128 + 3 / s) (numpy)."""
    qp = autoq.QParam.from_range(np.float64(-8.0), np.float64(8.0))
    spec = Config(recipe="cnn").activation
    got = cut(qp, (-3.0, None), spec)
    s, z = float(qp.scale), int(qp.zero_point)
    hi = (127 - z) * s  # the grid's top, kept
    want_s = (hi + 3.0) / 255
    assert float(got.scale) == pytest.approx(want_s, rel=1e-6)
    assert int(got.zero_point) == int(np.rint(-128 + 3.0 / want_s))
    assert cut(qp, (-20.0, None), spec) is qp  # already inside: unchanged


def test_cut_calibration_is_exact_and_closer_to_fp32():
    mod, params, data = conv_hswish_conv()
    want = np.stack([numpy_model(params, x) for x in data])
    errs = {}
    for on in (True, False):
        cfg = Config(recipe="cnn", rules=() + (("lookup_input_ranges",) if on else ()))
        sim = simulate(mod, params, cfg)
        qp = autoq.calibrate(sim, params, data, cfg, target=TARGET)
        lo = (qp["c1"].qmin - int(qp["c1"].zero_point)) * float(qp["c1"].scale)
        assert (lo > -3.0 - float(qp["c1"].scale)) == on  # (the zero point is rounded)
        real = realize(mod, params, qp, cfg)
        rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
        assert rep.exact, rep.table()
        got = np.stack([Runner(real)(x) for x in data])
        errs[on] = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert errs[True] < errs[False], errs


def test_config_round_trip():
    cfg = Config(recipe="cnn")
    assert Config.loads(cfg.dumps()) == cfg
    on = Config(recipe="cnn", rules=("lookup_input_ranges",))
    assert Config.loads(on.dumps()) == on and on.has_rule("lookup_input_ranges")


def test_cut_logit_is_not_a_scale_problem():
    """A probability map whose logits often lie beyond +-17 (bias -40): the cut clips
    over a quarter of the logit slot on purpose (same table entry), so ``check_scales`` keeps
    every layer int8 (it kept the logit and the sigmoid fp32: "values fall outside the
    grid"), and the map matches numpy's within the int8 steps."""
    import warnings

    b = Builder(12)
    x = b.input("x", (1, 1, 16, 16))

    def body(b):
        w = b.weight("c.weight", np.full((1, 1, 1, 1), 30.0))
        y = b.emit(relax.op.nn.conv2d(x, w))
        y = b.emit(relax.op.add(y, b.weight("c.bias", np.full((1, 1, 1, 1), -40.0))))
        return b.emit(relax.op.sigmoid(y))

    mod, params = b.build(body)
    rng = np.random.default_rng(4)
    data = [rng.uniform(0.0, 2.0, (1, 1, 16, 16)).astype(np.float32) for _ in range(10)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = autoq.Quantizer(Config(recipe="cnn"), target=TARGET).run(mod, params, data)
    assert not r.fp32_layers
    assert not r.qparams.meta["scale_problems"]
    z = data[0].astype(np.float64) * 30.0 - 40.0
    from autoq.calibration.scale_health import CLIPPED_LIMIT

    assert np.mean(np.abs(z) > 17) > CLIPPED_LIMIT  # enough beyond the cut to be "clipped"
    want = 1.0 / (1.0 + np.exp(-z))
    got = Runner(r.module)(data[0])
    assert np.abs(got - want).max() < 0.1
