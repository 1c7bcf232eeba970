"""Automatic int16 escalation of activation tensors (autoq.fallback.escalation) on a tiny
transformer block: the switchable graph predicts the int16 simulated graph, the search
keeps within its budget and finds the planted outlier tensor, and the realized result
equals its simulated graph bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import AutoFallback, Config
from autoq.calibration import calibrate, samples_for
from autoq.config import BiasCorrection, QuantSpec
from autoq.fallback.escalation import INT16_HEADROOM, EscalationGraph, escalate_search, int16_qparam
from autoq.fallback.fidelity import compare
from autoq.layer_rules import TRIAL_SAMPLES
from autoq.metrics import sqnr_db
from autoq.qparams import QParam
from autoq.realization import realize
from autoq.simulation import simulate
from models import TARGET, Builder, Runner

SEQ, DIM, HID = 8, 16, 32
OUTLIER = 3  # the residual-stream channel with large values (as in BERT's LayerNorm inputs)


def tiny_transformer(seed=0):
    """x -> q/k/v dense -> softmax(q k^T / 4) v -> dense + x -> LN -> dense -> gelu ->
    dense + residual -> LN; channel OUTLIER of the residual stream is ~40x the others."""
    b = Builder(seed)
    x = b.input("x", (1, SEQ, DIM))

    def dense(name, y, n_in, n_out):
        w = b.randw(f"{name}.weight", (n_out, n_in))
        out = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(out, b.weight(f"{name}.bias", b.rng.normal(size=n_out) * 0.1)))

    def ln(name, y):
        g, beta = b.weight(f"{name}.weight", np.ones(DIM)), b.weight(f"{name}.bias", np.zeros(DIM))
        return b.emit(relax.op.nn.layer_norm(y, g, beta, [-1]))

    def body(b):
        q, k, v = (dense(n, x, DIM, DIM) for n in ("q", "k", "v"))
        kt = b.emit(relax.op.permute_dims(k, [0, 2, 1]))
        s = b.emit(relax.op.multiply(b.emit(relax.op.matmul(q, kt)), relax.const(0.25, "float32")))
        p = b.emit(relax.op.nn.softmax(s, axis=-1))
        h = ln("ln1", b.emit(relax.op.add(dense("o", b.emit(relax.op.matmul(p, v)), DIM, DIM), x)))
        f = b.emit(relax.op.nn.gelu(dense("ffn.in", h, DIM, HID)))
        return ln("ln2", b.emit(relax.op.add(dense("ffn.out", f, HID, DIM), h)))

    return b.build(body)


def data(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(1, SEQ, DIM)).astype(np.float32)
        x[..., OUTLIER] *= 40.0
        out.append(x)
    return out


CFG = Config(recipe="cnn", check_scales=False)


@pytest.fixture(scope="module")
def calibrated():
    mod, params = tiny_transformer()
    sim = simulate(mod, params, CFG)
    qp = calibrate(sim, params, data(8, 1), CFG, target=TARGET)
    eg = EscalationGraph(sim, qp, data(8, 1), TARGET)
    return mod, params, sim, qp, eg


def test_int16_qparam_spans_the_observed_range():
    h = INT16_HEADROOM
    qp = int16_qparam(-2.0, 6.0, QuantSpec())
    assert qp.dtype == "int16" and qp.qmin == -32768 and qp.qmax == 32767
    grid = (np.array([qp.qmin, qp.qmax]) - qp.zero_point) * qp.scale
    assert grid[0] <= -2.0 * h + qp.scale and grid[1] >= 6.0 * h - qp.scale
    assert np.isclose(float(qp.scale), 8.0 * h / 65535, rtol=1e-6)
    pos = int16_qparam(0.5, 2.0, QuantSpec())  # the range always holds 0
    assert float(pos.rmin) == 0.0 and float(pos.rmax) == 2.0 * h


def test_switched_graph_predicts_the_int16_simulated_graph(calibrated):
    """All switches off: exactly the calibrated int8 simulated graph; one tensor on: the
    graph simulated with Config.int16_tensors=(that tensor,) (up to float32 rounding)."""
    mod, params, _sim, qp, eg = calibrated
    test = data(3, 9)
    real8 = Runner(realize(mod, params, qp, CFG))
    for got, x in zip(eg.run([], test), test, strict=True):
        np.testing.assert_array_equal(got, real8(x))
    # every escalable slot: the residual adds, layer norms, gelu (LUT) in/out, matmuls...
    assert len(eg.candidates) >= 10
    assert {"o", "ffn.in", "gelu_0", "softmax_0"} <= set(eg.candidates)
    # residual stream (dense + residual add, LN input), gelu (LUT) input and output, probs
    for sid in ("o", "ffn.in", "gelu_0", "softmax_0"):
        cfg16 = CFG.replace(int16_tensors=(sid,))
        sim16 = simulate(mod, params, cfg16)
        assert sim16.plan.specs[sid].dtype == "int16"
        assert sum(sp.dtype == "int16" for sp in sim16.plan.specs.values()) == 1
        qp16 = eg.qparams_with([sid], sim16)
        real16 = Runner(realize(mod, params, qp16, cfg16))
        # float32 rounding of the re-expressed integers may flip a downstream rounding
        # by one step, nothing more: far closer to int16 than to the int8 graph
        got16, ref16 = eg.run([sid], test), [real16(x) for x in test]
        assert sqnr_db(ref16, got16) > 40.0, sid
        assert sqnr_db(ref16, got16) >= sqnr_db(ref16, eg.run([], test)), sid


def test_search_finds_the_outlier_tensor_within_budget(calibrated):
    _mod, _params, sim, _qp, eg = calibrated
    fb = AutoFallback(precision="int16_tensors", min_sqnr=99.0, max_int16_fraction=0.2)
    held = samples_for(data(3, 5), sim.graph.inputs)
    found = escalate_search(eg, fb, eg.run_fp32, held)
    limit = int(0.2 * eg.n_activation_slots)
    assert 1 <= len(found["tensors"]) <= limit
    assert found["metric"] > found["base"] + 3.0  # >= 3 dB better on calibration samples
    # in the order of the measured ranking (most costly back in int8 first), a prefix
    ranked = [r["layer"] for r in found["ranking"]]
    assert found["tensors"] == ranked[: len(found["tensors"])]
    scores = [r["score"] for r in found["ranking"]]
    assert scores == sorted(scores)
    # the held-out samples chose the prefix: its held-out SQNR is the best one seen
    greedy = [t for t in found["trials"] if t["kind"] == "greedy"]
    assert greedy and greedy[len(found["tensors"]) - 1]["kept"]
    # the winner is a tensor carrying the outlier channel (residual stream / LN input)
    test = data(4, 11)
    ref = eg.run_fp32(test)
    assert sqnr_db(ref, eg.run(found["tensors"][:1], test)) > sqnr_db(ref, eg.run([], test)) + 1


def test_pipeline_realizes_the_choice_bit_exactly_and_round_trips():
    mod, params = tiny_transformer()
    fb = AutoFallback(precision="int16_tensors", min_sqnr=99.0)  # held-out: the search test
    # bias correction: a corrected int32 bias moves to the int16 input's accumulator scale
    cfg = Config(recipe="cnn", check_scales=False, fallback=fb, bias_correction=BiasCorrection())
    res = autoq.Quantizer(cfg).run(mod, params, data(10, 1))
    d = res.decision
    assert d.precision == "int16_tensors" and d.layers
    assert res.config.int16_tensors == tuple(d.layers) and not res.fp32_layers
    assert {res.qparams[s].dtype for s in d.layers} == {"int16"}
    assert Config.loads(res.config.dumps()) == res.config
    sim = simulate(res.matched, None, res.config)  # the model realized (SmoothQuant: rewritten)
    rep = compare(sim, res.module, res.qparams, samples_for(data(3, 4), sim.graph.inputs), TARGET)
    assert rep.exact, rep.table()
    fp, q8 = Runner(mod, params), Runner(autoq.quantize(mod, params, data(7, 1), CFG))
    q16 = Runner(res.module)
    test = data(4, 13)
    ref = [fp(x) for x in test]
    assert sqnr_db(ref, [q16(x) for x in test]) > sqnr_db(ref, [q8(x) for x in test]) + 1


def test_bad_int16_tensor_names_are_errors():
    mod, params = tiny_transformer()
    with pytest.raises(ValueError, match="int16_tensors"):
        simulate(mod, params, CFG.replace(int16_tensors=("no_such_tensor",)))
    with pytest.raises(ValueError, match="max_int16_fraction"):
        AutoFallback(precision="int16_tensors", max_int16_fraction=1.5)


def test_fixed_qparams_are_kept_and_calibrate_what_follows():
    """calibrate(fixed=...): the fixed slot keeps its qparams and the dense layer reading it
    is calibrated on its values quantized with them (numpy: x on the fixed grid times the
    per-channel int8 weight, max calibrator)."""
    mod, params = tiny_transformer()
    cfg = CFG.replace(activation=QuantSpec(calibrator="max"), weight_rounding="nearest")
    sim = simulate(mod, params, cfg)
    fixed = QParam(np.float32(0.5), np.int32(3), "int8")
    calib = data(4, 1)
    qp = calibrate(sim, params, calib, cfg, target=TARGET, fixed={"x": fixed})
    assert qp["x"] == fixed
    w, b = params["q.weight"].astype(np.float64), params["q.bias"].astype(np.float64)
    s = np.abs(w).max(axis=1, keepdims=True) / 127
    wq = np.clip(np.round(w / s), -127, 127) * s
    ys = []
    for x in calib:
        xq = (np.clip(np.round(x.astype(np.float32) / 0.5) + 3, -128, 127) - 3) * 0.5
        ys.append(xq[0] @ wq.T + b)
    want = QParam.from_range(min(min(y.min() for y in ys), 0), max(max(y.max() for y in ys), 0))
    assert np.isclose(float(qp["q"].scale), float(want.scale), rtol=1e-5)


def test_the_trials_measure_the_first_trial_samples(calibrated):
    """The base trial's SQNR is the all-int8 output SQNR on the first TRIAL_SAMPLES
    calibration samples."""
    _mod, _params, _sim, _qp, eg = calibrated
    some = list(eg.samples)[:TRIAL_SAMPLES]
    assert 0 < len(some) < len(list(eg.samples))  # the test data has more samples
    fb = AutoFallback(precision="int16_tensors", min_sqnr=99.0)
    found = escalate_search(eg, fb, eg.run_fp32)
    base = next(t for t in found["trials"] if t["kind"] == "base")["metric"]
    assert base == pytest.approx(sqnr_db(eg.run_fp32(some), eg.run([], some)), rel=1e-9)
