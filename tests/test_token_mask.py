"""Calibration statistics over real tokens only (autoq.token_mask): on a tiny padded block
(LayerNorm -> flatten to rows -> dense -> masked mean pooling) whose padded positions hold
values 50x larger than the real ones, every statistic named in the module docstring is
checked against numpy computed on the real tokens only."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config, QuantSpec, TokenMask
from autoq.calibrate import (
    calibrate,
    calibrate_weights,
    calibration_pipeline,
    observe,
    samples_for,
    static_values,
)
from autoq.calibration_plan import build_plan, slot_layouts
from autoq.errors import DatasetError, InputError
from autoq.escalation import EscalationGraph, int16_qparam
from autoq.matching import match
from autoq.metrics import sqnr_db
from autoq.shard_runner import ShardRunner
from autoq.simulate import simulate
from autoq.smooth_quant import activation_maxima, find_smoothable
from autoq.token_mask import real_tokens, token_layout
from autoq.toolkit import compile_vm
from models import TARGET, Builder, Runner

SEQ, DIM, OUT = 8, 16, 12
REAL = (3, 6, 8, 5)  # real tokens per sample; the rest is padding
MASK = TokenMask("mask")
CFG = Config(
    progress=False,
    check_scales=False,
    smooth_quant=None,
    weight_rounding="nearest",
    activation=QuantSpec(calibrator="max"),
)


def padded_block(seed=0):
    """x (1, S, D), mask (1, S) -> LayerNorm -> reshape (S, D) -> dense -> reshape (1, S, N)
    -> times mask -> sum over tokens / number of real tokens (masked mean pooling)."""
    b = Builder(seed)
    x, mask = b.input("x", (1, SEQ, DIM)), b.input("mask", (1, SEQ))

    def body(b):
        gamma = np.ones(DIM)
        gamma[2] = 8.0  # an outlier channel, as SmoothQuant expects
        ln = b.emit(relax.op.nn.layer_norm(x, b.weight("ln.weight", gamma),
                                           b.weight("ln.bias", np.zeros(DIM)), [-1]))  # fmt: skip
        rows = b.emit(relax.op.reshape(ln, (SEQ, DIM)))
        w = b.randw("fc.weight", (OUT, DIM))
        y = b.emit(relax.op.matmul(rows, relax.op.permute_dims(w, [1, 0])))
        y = b.emit(relax.op.add(y, b.weight("fc.bias", b.rng.normal(size=OUT) * 0.1)))
        y = b.emit(relax.op.reshape(y, (1, SEQ, OUT)))
        m = b.emit(relax.op.expand_dims(mask, -1))
        pooled = b.emit(relax.op.sum(b.emit(relax.op.multiply(y, m)), axis=[1]))
        return b.emit(relax.op.divide(pooled, relax.op.sum(m, axis=[1])))

    return b.build(body)


def data(n=4, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        real = REAL[i % len(REAL)]
        x = rng.normal(size=(1, SEQ, DIM)).astype(np.float32)
        x[:, real:] *= 0.01  # padding: one huge channel (the model never uses these rows)
        x[:, real:, 2] = 100.0
        mask = np.zeros((1, SEQ), np.float32)
        mask[:, :real] = 1.0
        out.append({"x": x, "mask": mask})
    return out


def layer_norm(x, gamma, beta, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def numpy_model(params, sample):
    """(LayerNorm output, dense output) of one sample, in float64."""
    ln = layer_norm(sample["x"][0].astype(np.float64), params["ln.weight"], params["ln.bias"])
    return ln, ln @ params["fc.weight"].T.astype(np.float64) + params["fc.bias"]


def real(sample, a):
    return a[sample["mask"][0] != 0]


@pytest.fixture(scope="module")
def model():
    mod, params = padded_block()
    return mod, params, simulate(mod, params, CFG)


#: the activation slots of padded_block and their token layout
LAYOUTS = {"reshape_0": "rows", "reshape_1": "tokens", "expand_dims_0": "tokens",
           "multiply_0": "tokens"}  # fmt: skip
LN_ROWS, DENSE = "reshape_0", "reshape_1"  # the flattened LN output, the dense output


def max_qparam(arrays):
    return observe(CFG.activation, arrays, None, lambda: arrays)


def test_layouts_and_selection():
    assert token_layout((1, 8, 16), (1, 8)) == "tokens"
    assert token_layout((2, 8, 16), (2, 8)) == "tokens"
    assert token_layout((16, 5), (2, 8)) == "rows"
    assert token_layout((2, 4, 8, 8), (2, 8)) is None  # attention (B, heads, S, S)
    assert token_layout((2, 16), (2, 8)) is None  # pooled
    x = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    keep = np.array([[True, False, True], [False, False, True]])
    assert real_tokens(x, keep, "tokens").tolist() == [[0, 1], [4, 5], [10, 11]]
    assert real_tokens(x.reshape(6, 2), keep, "rows").tolist() == [[0, 1], [4, 5], [10, 11]]
    assert real_tokens(x, keep, None) is x


def test_slots_laid_out_per_token(model):
    _, _, sim = model
    assert slot_layouts(sim, MASK) == LAYOUTS
    assert slot_layouts(sim, None) == {}


def test_topological_ranges_over_real_tokens(model):
    """The flattened LayerNorm output's qparams (its first slot: float values) are the
    calibrator's on numpy's LayerNorm of the real tokens only."""
    _, params, sim = model
    samples = data()
    masked = calibrate(sim, None, samples, CFG.replace(token_mask=MASK), target=TARGET)
    plain = calibrate(sim, None, samples, CFG, target=TARGET)
    lns = [numpy_model(params, s)[0] for s in samples]
    want = max_qparam([real(s, ln) for s, ln in zip(samples, lns, strict=True)])
    whole = max_qparam(lns)
    assert np.isclose(float(masked[LN_ROWS].scale), float(want.scale), rtol=1e-5)
    assert np.isclose(float(plain[LN_ROWS].scale), float(whole.scale), rtol=1e-5)
    assert float(masked[LN_ROWS].scale) < 0.8 * float(plain[LN_ROWS].scale)


def test_fp32_calibration_over_real_tokens(model):
    """calibration="fp32": the LayerNorm output (rows) and the dense output (tokens)
    ranges are numpy's over the real tokens."""
    _, params, sim = model
    samples = data()
    qp = calibrate(sim, None, samples, CFG.replace(token_mask=MASK, calibration="fp32"), TARGET)
    refs = [numpy_model(params, s) for s in samples]
    for i, sid in enumerate((LN_ROWS, DENSE)):
        want = max_qparam([real(s, r[i]) for s, r in zip(samples, refs, strict=True)])
        assert np.isclose(float(qp[sid].scale), float(want.scale), rtol=1e-5), sid


def test_shard_runner_feeds_real_rows(model):
    """What GPTQ's Hessians and the bias-correction means are fed (ShardRunner.feed): the
    real rows only, on every sample."""
    _, params, sim = model
    samples = data()
    plan, functions = build_plan(sim, MASK)
    vm = compile_vm(functions, TARGET, sim.mod, pipeline=calibration_pipeline(TARGET))
    runner = ShardRunner(vm, plan, static_values(sim, plan, calibrate_weights(sim)), 2**26)
    runner.load(samples)
    runner.run_prologue()
    for j, seg in enumerate(plan.segments):  # up to the segment the slot starts
        if LN_ROWS in seg.heads:
            break
        assert not seg.heads
        runner.run_segment(j, {})

    class Sink:
        def __init__(self):
            self.seen = []

        def update(self, x):
            self.seen.append(np.array(x))

    got = runner.feed(LN_ROWS, Sink()).seen
    runner.close()
    assert [a.shape for a in got] == [(r, DIM) for r in REAL]
    for a, s in zip(got, samples, strict=True):
        np.testing.assert_allclose(a, real(s, numpy_model(params, s)[0]), rtol=1e-4, atol=1e-4)


def test_smooth_quant_maxima_over_real_tokens(model):
    mod, params, _ = model
    g = match(mod, params, CFG).graph
    plans = find_smoothable(g)
    assert len(plans) == 1
    samples = samples_for(data(), g.inputs)
    (got,) = activation_maxima(g, plans, samples, TARGET, MASK)
    lns = [real(s, numpy_model(params, s)[0]) for s in data()]
    want = np.max([np.abs(a).max(axis=0) for a in lns], axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    (whole,) = activation_maxima(g, plans, samples, TARGET)
    assert whole[2] > 1.2 * got[2]  # the padding reached the unmasked maxima


def test_escalation_int16_ranges_over_real_tokens(model):
    _, params, sim = model
    samples = data()
    qp = calibrate(sim, None, samples, CFG.replace(token_mask=MASK), target=TARGET)
    eg = EscalationGraph(sim, qp, samples, TARGET, MASK)
    lns = [real(s, numpy_model(params, s)[0]) for s in samples]
    lo, hi = min(float(a.min()) for a in lns), max(float(a.max()) for a in lns)
    want = int16_qparam(lo, hi, sim.plan.specs[LN_ROWS])
    assert np.isclose(float(eg.qparams16[LN_ROWS].scale), float(want.scale), rtol=1e-5)


def test_quantize_end_to_end_and_json():
    mod, params = padded_block()
    cfg = CFG.replace(token_mask=MASK)
    assert Config.loads(cfg.dumps()) == cfg and Config.loads(cfg.dumps()).token_mask == MASK
    assert Config.loads(CFG.dumps()).token_mask is None
    calib = data(16)
    res = autoq.Quantizer(cfg).run(mod, params, calib)
    assert res.config.token_mask == MASK
    lns = [numpy_model(params, s)[0] for s in calib]
    want = max_qparam([real(s, ln) for s, ln in zip(calib, lns, strict=True)])
    assert np.isclose(float(res.qparams[LN_ROWS].scale), float(want.scale), rtol=1e-5)
    # the model output (masked mean pooling) against numpy, on new padded samples: closer
    # with the statistics of the real tokens than with the padding's
    test = data(8, seed=7)
    ref = []
    for s in test:
        _, y = numpy_model(params, s)
        ref.append((real(s, y).mean(axis=0)[None]).astype(np.float32))
    plain = autoq.quantize(mod, params, calib, CFG)
    got = {name: [Runner(m)(s["x"], s["mask"]) for s in test]
           for name, m in (("mask", res.module), ("plain", plain))}  # fmt: skip
    assert sqnr_db(ref, got["mask"]) > sqnr_db(ref, got["plain"]) + 1  # 31.9 vs 29.7 dB


def test_bad_options_name_the_option():
    with pytest.raises(InputError, match=r"Config\.token_mask"):
        Config(token_mask="mask")
    with pytest.raises(InputError, match=r"Config\.token_mask\.input"):
        TokenMask("")
    mod, params = padded_block()
    with pytest.raises(InputError, match=r"token_mask.input = 'attention_mask'.*\['mask', 'x'\]"):
        autoq.quantize(mod, params, data(), CFG.replace(token_mask=TokenMask("attention_mask")))
    with pytest.raises(InputError, match=r"token_mask.input = 'x' has shape \(1, 8, 16\)"):
        autoq.quantize(mod, params, data(), CFG.replace(token_mask=TokenMask("x")))
    empty = [dict(s, mask=np.zeros_like(s["mask"])) for s in data()]
    with pytest.raises(DatasetError, match="no real token"):
        autoq.quantize(mod, params, empty, CFG.replace(token_mask=MASK))


def test_dynamic_gptq_hessian_over_real_tokens(model):
    """Config.dynamic_gptq with a token mask: the dynamic dense layer's GPTQ Hessian is
    2 X^T X / n over the real rows of its input (the LayerNorm output) only; the padded
    rows (one channel at 100) would dominate it. The weights equal a numpy GPTQ on the
    real-token Hessian and differ from one on every row's."""
    from test_dynamic_gptq import _numpy_gptq

    from autoq import Override

    mod, params, _ = model
    samples = data(12)  # 66 real rows for fc's 16 columns (>= 4 per column)
    token = QuantSpec(dynamic=True, granularity="token")
    cfg = CFG.replace(weight_rounding="gptq", dynamic_gptq=True, token_mask=MASK,
                      overrides=(Override("pattern:dense*", activation=token),))  # fmt: skip
    res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, samples)
    assert res.qparams.meta["stats"]["dynamic_gptq"] == 1
    got = res.qparams.values["fc.weight"].T.astype(np.int64)  # (in, out) -> (out, in)
    scale = np.asarray(res.qparams["fc.weight"].scale, np.float64)

    def gptq_on(rows):
        x = np.concatenate(rows)
        return _numpy_gptq(params["fc.weight"].astype(np.float64), 2.0 * x.T @ x / len(x), scale)

    lns = [(s, numpy_model(params, s)[0]) for s in samples]
    want = gptq_on([real(s, ln) for s, ln in lns])
    every = gptq_on([ln for _, ln in lns])
    assert (got != want).mean() < 0.02 and np.abs(got - want).max() <= 1
    assert (got != every).mean() > 0.1, (got != every).mean()
