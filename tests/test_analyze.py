"""autoq.analyze (per-layer report), AutoFallback and int16 activations.

The model with a planted outlier (``outlier_cnn``): conv c2's output channel 0 is ~50x
larger than the others (weights and bias scaled), and c3, a depthwise conv (the MobileNet
case), reads it with its channel-0 filter divided by 50, so c3's output is an ordinary
tensor (and its per-channel weight scales absorb the division exactly). With one per-tensor
int8 scale for c3's input, the other seven channels keep only a few levels: c3 is the layer
that hurts, and only c3 (fp32, or int16 activations) fixes it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import (
    Analysis,
    AutoFallback,
    Config,
    Fallback,
    FallbackDecision,
    Override,
    QuantSpec,
    Report,
    analyze,
    calibrate,
    qnn,
    realize,
    simulate,
)
from autoq import primitives as P
from autoq.calibration import samples_for
from autoq.fallback.auto_fallback import remap_qparams
from autoq.fallback.fidelity import compare
from autoq.metrics import sqnr_db
from models import TARGET, Builder, Runner, conv, image_data, run_tuple, small_cnn

FACTOR = 50.0


def outlier_cnn(seed=0):
    """c1 -> relu -> c2 (channel 0 x50) -> relu -> depthwise c3 (channel 0 / 50) -> relu
    -> c4 -> global mean -> fc."""
    b = Builder(seed)
    x = b.input("x", (1, 4, 8, 8))

    def conv_with(y, name, w, bias, groups=1):
        wv, bv = b.weight(f"{name}.weight", w), b.weight(f"{name}.bias", bias)
        y = b.emit(relax.op.nn.conv2d(y, wv, padding=1, groups=groups))
        return b.emit(relax.op.add(y, relax.op.reshape(bv, [1, -1, 1, 1])))

    def body(b):
        y = b.emit(relax.op.nn.relu(conv(b, x, "c1", 4, 8)))
        w2 = b.rng.normal(size=(8, 8, 3, 3)).astype(np.float32) / np.sqrt(72)
        b2 = (b.rng.normal(size=(8,)) * 0.1).astype(np.float32)
        w2[0] *= FACTOR
        b2[0] = abs(b2[0]) * FACTOR
        y = b.emit(relax.op.nn.relu(conv_with(y, "c2", w2, b2)))
        w3 = b.rng.normal(size=(8, 1, 3, 3)).astype(np.float32) / 3
        w3[0] /= FACTOR
        y = b.emit(relax.op.nn.relu(conv_with(y, "c3", w3, b.rng.normal(size=(8,)) * 0.1, 8)))
        y = conv(b, y, "c4", 8, 8)
        y = b.emit(relax.op.mean(y, axis=[2, 3], keepdims=False))
        w = b.randw("fc.weight", (4, 8))
        fb = b.weight("fc.bias", b.rng.normal(size=(4,)) * 0.1)
        return b.emit(
            relax.op.add(b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0]))), fb)
        )

    mod, params = b.build(body)
    return mod, params, lambda n=8, seed=1: image_data((1, 4, 8, 8), seed, n)


def cfg(**kw):
    return Config(recipe="cnn", **kw)


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def decision_of(mod) -> FallbackDecision:
    return FallbackDecision.loads(str(mod.attrs["autoq.fallback"]))


def count_ops(mod, name):
    return sum(
        1
        for blk in mod["main"].body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == name
    )


# ------------------------------------------------------------------------------ the switch


def test_simulated_quantize_switch_on_is_quantize_off_is_unrounded():
    x = (np.random.default_rng(0).normal(size=(2, 7)) * 4).astype(np.float32)
    f32 = lambda v: relax.const(np.asarray(v, np.float32))  # noqa: E731
    i32 = lambda v: relax.const(np.asarray(v, np.int32))  # noqa: E731
    on, off, plain = run_tuple(
        {"x": x, "e1": np.float32(1.0), "e0": np.float32(0.0)},
        lambda x, e1, e0: [
            qnn.simulated_quantize(x, f32(0.03), i32(5), enable=e1),
            qnn.simulated_quantize(x, f32(0.03), i32(5), enable=e0),
            qnn.simulated_quantize(x, f32(0.03), i32(5)),
        ],
    )
    ref = P.quantize(x, np.float32(0.03), 5).astype(np.float32)
    np.testing.assert_array_equal(on, ref)
    np.testing.assert_array_equal(plain, ref)
    np.testing.assert_array_equal(off, x / np.float32(0.03) + np.float32(5))
    assert np.abs(off).max() > 127  # neither clipped ...
    assert not np.array_equal(off, np.rint(off))  # ... nor rounded


def test_switch_must_be_a_float32_scalar():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(Exception, match=r"qnn.simulated_quantize: argument 'enable' must be"):
        run_tuple(
            {"x": x, "e": np.ones(3, np.float32)},
            lambda x, e: [
                qnn.simulated_quantize(
                    x, relax.const(np.float32(1)), relax.const(np.int32(0)), enable=e
                )
            ],
        )


def test_switched_graph_equals_the_realized_graph_and_switches_off_give_fp32():
    mod, params, make = small_cnn()
    data = make(6, 1)
    sim = simulate(mod, params, cfg())
    qp = calibrate(sim, params, data, cfg(), target=TARGET)
    an = Analysis(mod, params, data, qp, cfg(), target=TARGET)
    assert set(an.sim.switch_vars) == set(an.layers) == set(sim.layers)
    # every switch on: exactly the calibrated simulated graph, i.e. the realized int8 graph
    real = Runner(realize(mod, params, qp, cfg()))
    for got, x in zip(an.run(), data, strict=True):
        np.testing.assert_array_equal(got, real(x))
    # every switch off: the fp32 model (up to float32 rounding of x / s * s)
    fp = Runner(mod, params)
    for got, x in zip(an.run(an.layers), data, strict=True):
        np.testing.assert_allclose(got, fp(x), rtol=1e-4, atol=1e-5)
    # one layer off: what realize computes with that layer in Fallback (same qparams)
    fb_cfg = cfg(fallback=Fallback(ids=("block.conv1",)))
    fb_qp = remap_qparams(sim, qp, simulate(mod, params, fb_cfg))
    fb_real = Runner(realize(mod, params, fb_qp, fb_cfg))
    trial = an.run(["block.conv1"])
    for got, x in zip(trial, data, strict=True):
        ref = fb_real(x)
        assert rel_err(got, ref) < 1e-3
    assert (
        rel_err(np.stack(trial), np.stack([fp(x) for x in data]))
        < rel_err(np.stack(an.run()), np.stack([fp(x) for x in data])) * 1.5
    )


# ------------------------------------------------------------------------------ the report


def test_report_ranks_the_planted_outlier_layer_first_and_round_trips(tmp_path):
    mod, params, make = outlier_cnn()
    # round-to-nearest weights: the report's "alone" inputs are then exactly the values
    # calibration saw (GPTQ changes c2's weights, so c3's fp32 input would clip a little)
    rep = analyze(mod, params, make(), cfg(weight_rounding="nearest"), target=TARGET)
    assert [s.layer for s in rep.layers] == ["c1", "c2", "c3", "c4", "mean_0", "fc"]
    ranked = rep.ranked()
    assert ranked[0].layer == "c3"
    # c3 alone loses > 15 dB more than any other layer alone
    assert ranked[0].sqnr_alone < min(s.sqnr_alone for s in ranked[1:]) - 15
    # its input slot: same chosen range as calibration, unclipped, low resolution
    c3 = rep.layer("c3")
    assert c3.slots == ["relu_1", "c3.weight"]
    inp = rep.slot("relu_1")
    assert inp.kind == "activation" and inp.layer == "c3" and inp.dtype == "int8"
    assert inp.clipped == 0.0 and inp.elements == 8 * 8 * 8 * 8
    # the first layer's input is the model input: alone == upstream
    c1 = rep.layer("c1")
    assert c1.sqnr_alone == pytest.approx(c1.sqnr_upstream)
    # accumulators: every accumulating layer reports its headroom, the mean too
    assert all(s.acc_max is not None and s.acc_max > 0 for s in rep.layers)
    assert all(s.exact for s in rep.layers)
    # the damage-sorted table lists c3 first
    text = rep.table()
    assert text.splitlines()[2].split()[1] == "c3"
    back = Report.loads(rep.dumps())
    assert back == rep and back.dumps() == rep.dumps()
    json.dumps(json.loads(rep.dumps()), allow_nan=False)  # plain JSON (inf written as a string)
    try:  # matplotlib is an optional extra (autoq[plot]): without it, a warning and no file
        import matplotlib  # noqa: F401

        png = rep.plot(tmp_path / "sqnr.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    except ImportError:
        with pytest.warns(UserWarning, match="needs matplotlib"):
            assert rep.plot(tmp_path / "sqnr.png") is None
        assert not (tmp_path / "sqnr.png").exists()


def test_report_numbers_match_numpy_on_a_dense_layer():
    """One dense layer: the "alone" SQNR and the accumulator headroom, recomputed in numpy
    from the calibrated qparams."""
    b = Builder(1)
    x = b.input("x", (4, 16))
    w = b.randw("fc.weight", (8, 16))
    bias = b.weight("fc.bias", b.rng.normal(size=(8,)) * 0.1)
    mod, params = b.build(
        lambda b: b.emit(
            relax.op.add(b.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0]))), bias)
        )
    )
    data = image_data((4, 16), 3, 5)
    sim = simulate(mod, params, cfg())
    qp = calibrate(sim, params, data, cfg(), target=TARGET)
    rep = analyze(mod, params, data, qp, target=TARGET, accumulator="int8")
    xq, wq = qp["x"], qp["fc.weight"]
    ref2 = err2 = 0.0
    accmax, over = 0, 0
    for d in data:
        qx = P.quantize(d, xq.scale, xq.zero_point).astype(np.int64) - int(xq.zero_point)
        qw = P.quantize(params["fc.weight"], wq.scale, wq.zero_point, axis=0).astype(np.int64)
        qb = P.quantize_bias(params["fc.bias"], xq.scale, wq.scale).values.astype(np.int64)
        acc = qx @ qw.T + qb
        y = acc.astype(np.float32) * (xq.scale * wq.scale).astype(np.float32)
        f = d.astype(np.float64) @ params["fc.weight"].T.astype(np.float64) + params["fc.bias"]
        ref2 += float((f**2).sum())
        err2 += float(((f - y) ** 2).sum())
        accmax = max(accmax, int(np.abs(acc).max()))
        over += int(np.count_nonzero((acc > 127) | (acc < -128)))
    fc = rep.layer("fc")
    assert fc.sqnr_alone == pytest.approx(10 * np.log10(ref2 / err2), abs=1e-3)
    assert fc.acc_max == accmax and fc.acc_overflow == over and fc.acc_elements == 5 * 4 * 8
    assert rep.output_sqnr == pytest.approx(fc.sqnr_upstream)


# ---------------------------------------------------------------------------- AutoFallback


def test_autofallback_keeps_exactly_the_outlier_layer_in_fp32():
    mod, params, make = outlier_cnn()
    data, test = make(8, 1), make(4, 7)
    plain = autoq.quantize(mod, params, data, cfg(), target=TARGET)
    out = autoq.quantize(
        mod, params, data, cfg(fallback=AutoFallback(min_sqnr=38.0)), target=TARGET
    )
    d = decision_of(out)
    # c3 (whose input holds the outlier channel) ranks first; since every layer exits as
    # int8 (autoq.rules.exits), c3 in fp32 still reads c2's int8 output: the outlier's producer
    # c2 must go to fp32 too, and the search finds exactly that pair
    assert d.layers == ["c3", "c2"] and d.precision == "fp32" and d.met
    assert d.ranking[0]["layer"] == "c3" and "SQNR" in d.ranking[0]["reason"]
    assert [t["layers"] for t in d.trials] == [[], ["c3", "c2"]]
    assert d.trials[0]["metric"] < 38.0 <= d.trials[1]["metric"] == d.metric
    assert count_ops(plain, "qnn.conv2d") == 4 and count_ops(out, "qnn.conv2d") == 2
    # the realized module is what the trial measured, and much closer to fp32
    fp, q0, q1 = Runner(mod, params), Runner(plain), Runner(out)
    ref = np.stack([fp(x) for x in test])
    assert rel_err(np.stack([q1(x) for x in test]), ref) < 0.5 * rel_err(
        np.stack([q0(x) for x in test]), ref
    )
    got = sqnr_db([fp(x) for x in data], [q1(x) for x in data])
    assert got == pytest.approx(d.metric, abs=0.05)
    # the qparams attached are those of the realized model (c3's input slot is gone)
    qp = autoq.QParams.loads(str(out.attrs["autoq.qparams"]))
    assert "relu_1" not in qp and "c3.weight" not in qp and "c2.weight" not in qp
    assert "relu_2" in qp


def test_autofallback_within_budget_keeps_everything_int8_and_respects_the_cap():
    mod, params, make = outlier_cnn()
    data = make(8, 1)
    an = Analysis(
        mod,
        params,
        data,
        calibrate(simulate(mod, params, cfg()), params, data, cfg(), target=TARGET),
        cfg(),
        target=TARGET,
    )
    rep = an.report()
    from autoq.fallback.auto_fallback import search_fallback

    d = search_fallback(an, AutoFallback(min_sqnr=0.0), rep)
    assert d.layers == [] and d.met and len(d.trials) == 1
    with pytest.warns(UserWarning, match="not reached"):
        d = search_fallback(an, AutoFallback(min_sqnr=500.0, max_fp32_layers=2), rep)
    # trials: all int8, then c3 with c2 (its int32 feeder): the cap of 2 layers stops there
    assert not d.met and len(d.layers) <= 2 and [len(t["layers"]) for t in d.trials] == [0, 2]
    # "revert" ranking: one trial per layer (with the layers feeding it int32 results), c3
    # (with c2) still first
    d = search_fallback(an, AutoFallback(min_sqnr=38.0, ranking="revert"), rep)
    assert d.ranking[0]["layer"] == "c3" and d.layers == ["c3", "c2"]


HELD_OUT = None


def heldout_accuracy(run):
    """A module-level user metric (so that it round-trips through JSON): agreement of the
    argmax with the fp32 model on held-out samples."""
    data, labels = HELD_OUT
    outs = run(data)
    return float(np.mean([np.argmax(o) == lab for o, lab in zip(outs, labels, strict=True)]))


def test_user_metric_callable_is_honoured():
    global HELD_OUT
    mod, params, make = outlier_cnn()
    data = make(8, 1)
    test = make(24, 11)
    fp = Runner(mod, params)
    HELD_OUT = (test, [int(np.argmax(fp(x))) for x in test])
    calls = []

    def metric(run):
        calls.append(1)
        return heldout_accuracy(run)

    # budget 0: every held-out label must survive; the metric decides, not the SQNR
    out = autoq.quantize(
        mod, params, data, cfg(fallback=AutoFallback(metric=metric, max_drop=0.0)), target=TARGET
    )
    d = decision_of(out)
    assert d.reference == 1.0 and d.metric_name == "metric"
    assert len(calls) == 1 + len(d.trials)  # the fp32 reference + one call per trial
    assert d.met and d.metric == 1.0 and d.trials[-1]["metric"] == 1.0
    q = Runner(out)
    assert heldout_accuracy(lambda xs: [q(x) for x in xs]) == 1.0
    # a metric that cannot be met with fewer than all layers in fp32
    n_layers = 6
    out = autoq.quantize(
        mod,
        params,
        data,
        cfg(fallback=AutoFallback(metric=lambda run: -rel_err(
            np.stack(run(test[:4])), np.stack([fp(x) for x in test[:4]])), max_drop=1e-4,
            max_fp32_layers=n_layers)),
        target=TARGET,
    )  # fmt: skip
    d = decision_of(out)
    assert d.met and len(d.layers) == n_layers and count_ops(out, "qnn.conv2d") == 0


def test_autofallback_config_round_trips_and_validates():
    a = AutoFallback(ids=("c1",), min_sqnr=25.0, max_fp32_layers=3, ranking="revert")
    c = Config(recipe="cnn", fallback=a)
    back = Config.loads(c.dumps())
    assert back == c and isinstance(back.fallback, AutoFallback)
    assert not AutoFallback() and a and a.fixed() == Fallback(ids=("c1",))
    m = Config(recipe="cnn", fallback=AutoFallback(metric=heldout_accuracy))
    assert Config.loads(m.dumps()).fallback.metric is heldout_accuracy
    with pytest.raises(ValueError, match="lambdas and local functions do not"):
        Config(recipe="cnn", fallback=AutoFallback(metric=lambda run: 0.0)).dumps()
    with pytest.raises(ValueError, match="ranking must be one of local, revert"):
        AutoFallback(ranking="best")
    with pytest.raises(ValueError, match="precision must be one of fp32, int16"):
        AutoFallback(precision="int4")
    with pytest.raises(ValueError, match="metric must be 'sqnr' or a callable"):
        AutoFallback(metric="accuracy")
    with pytest.raises(ValueError, match="max_fp32_layers must be an int >= 0"):
        AutoFallback(max_fp32_layers=-1)


# -------------------------------------------------------------------------------- int16


def test_int16_override_end_to_end_is_bit_exact_and_fixes_the_outlier():
    mod, params, make = outlier_cnn()
    data, test = make(8, 1), make(4, 7)
    c16 = cfg(overrides=(Override("c3", activation=QuantSpec(dtype="int16", calibrator="max")),))
    sim = simulate(mod, params, c16)
    assert sim.plan.specs["relu_1"].dtype == "int16" and sim.plan.specs["relu_2"].dtype == "int8"
    qp = calibrate(sim, params, data, c16, target=TARGET)
    assert qp["relu_1"].dtype == "int16"
    real = realize(mod, params, qp, c16)
    convs = [
        b.value
        for blk in real["main"].body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "qnn.conv2d"
    ]
    assert [str(c.args[0].ty.dtype) for c in convs] == ["int8", "int8", "int16", "int8"]
    rep = compare(sim, real, qp, samples_for(test, sim.graph.inputs), target=TARGET)
    assert rep.exact and "relu_1" in rep.elements, rep.table()
    # and the headroom the report shows stays inside the exact range
    an = analyze(mod, params, data, qp, config=c16, target=TARGET)
    assert an.layer("c3").exact and an.layer("c3").acc_max > 2**15
    assert (
        an.layer("c3").sqnr_alone
        > analyze(mod, params, data, cfg(), target=TARGET).layer("c3").sqnr_alone + 20
    )
    fp, q16 = Runner(mod, params), Runner(real)
    q8 = Runner(autoq.quantize(mod, params, data, cfg(), target=TARGET))
    ref = np.stack([fp(x) for x in test])
    assert rel_err(np.stack([q16(x) for x in test]), ref) < 0.5 * rel_err(
        np.stack([q8(x) for x in test]), ref
    )


def test_int16_weights_end_to_end():
    """int16 weights (with int8 activations) on the depthwise layer: realized as a
    qnn.conv2d with an int16 weight constant, bit-exact with the simulated graph."""
    mod, params, make = outlier_cnn()
    data, test = make(8, 1), make(4, 7)
    w16 = QuantSpec(dtype="int16", symmetric=True, narrow_range=True, per_channel=True)
    c16 = cfg(overrides=(Override("c3", weight=w16),))
    sim = simulate(mod, params, c16)
    qp = calibrate(sim, params, data, c16, target=TARGET)
    assert qp["c3.weight"].dtype == "int16" and qp["c2.weight"].dtype == "int8"
    real = realize(mod, params, qp, c16)
    weights = [
        str(b.value.args[1].ty.dtype)
        for blk in real["main"].body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "qnn.conv2d"
    ]
    assert weights == ["int8", "int8", "int16", "int8"]
    rep = compare(sim, real, qp, samples_for(test, sim.graph.inputs), target=TARGET)
    assert rep.exact, rep.table()


def test_autofallback_may_choose_int16():
    mod, params, make = outlier_cnn()
    data = make(8, 1)
    out = autoq.quantize(
        mod,
        params,
        data,
        cfg(fallback=AutoFallback(min_sqnr=38.0, precision="int16")),
        target=TARGET,
    )
    d = decision_of(out)
    # c3 with its int32 feeder c2 (see test_autofallback_keeps_exactly_the_outlier_layer...)
    assert d.layers == ["c3", "c2"] and d.precision == "int16" and d.met
    assert d.int16_metric == d.metric >= 38.0
    assert [t.get("precision", "fp32") for t in d.trials] == ["fp32", "fp32", "int16"]
    assert count_ops(out, "qnn.conv2d") == 4
    qp = autoq.QParams.loads(str(out.attrs["autoq.qparams"]))
    # the inputs of c3 and c2 in int16 (c2 writes c3's input: its requantize goes to int16)
    assert qp["relu_1"].dtype == "int16" and qp["relu_0"].dtype == "int16"
    assert qp["relu_2"].dtype == "int8"
    # the int16 trial's number is what the realized module computes
    fp, q = Runner(mod, params), Runner(out)
    assert sqnr_db([fp(x) for x in data], [q(x) for x in data]) == pytest.approx(d.metric, abs=0.05)


def test_qnn_accumulating_ops_take_int16_activations():
    rng = np.random.default_rng(4)
    xq = rng.integers(-32768, 32767, size=(1, 3, 5, 5)).astype(np.int16)
    wq = rng.integers(-127, 127, size=(4, 3, 3, 3)).astype(np.int8)
    a = rng.integers(-32768, 32767, size=(3, 6)).astype(np.int16)
    bq = rng.integers(-32768, 32767, size=(6, 2)).astype(np.int16)
    f32 = lambda v: relax.const(np.asarray(v, np.float32))  # noqa: E731
    i32 = lambda v: relax.const(np.asarray(v, np.int32))  # noqa: E731
    conv_out, dense_out, mm_out = run_tuple(
        {"x": xq, "w": wq, "a": a, "b": bq},
        lambda x, w, a, b: [
            qnn.conv2d(x, w, f32(1), i32(-5), f32([1] * 4), i32(0), padding=(1, 1)),
            qnn.dense(a, relax.op.permute_dims(b, [1, 0]), f32(1), i32(7), f32(1), i32(3)),
            qnn.matmul(a, b, f32(1), i32(7), f32(1), i32(-2)),
        ],
    )
    from models import conv2d_nchw

    np.testing.assert_array_equal(
        conv_out, conv2d_nchw(xq.astype(np.int64) + 5, wq.astype(np.int64), pad=1)
    )
    a64, b64 = a.astype(np.int64), bq.astype(np.int64)
    np.testing.assert_array_equal(dense_out, (a64 - 7) @ (b64 - 3))
    np.testing.assert_array_equal(mm_out, (a64 - 7) @ (b64 + 2))
