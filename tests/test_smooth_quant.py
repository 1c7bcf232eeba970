"""SmoothQuant (autoq.smoothing, autoq.smooth_quant): the rewritten float model computes the
same function, the LayerNorm outputs lose their outlier channel, and the quantized model is
closer to fp32 with it than without, on a tiny post-LN + pre-LN transformer block."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config
from autoq.calibrate import samples_for
from autoq.fidelity import compare
from autoq.matching import match
from autoq.metrics import sqnr_db
from autoq.simulate import simulate
from autoq.smooth_quant import find_smoothable, smooth_graph
from autoq.smoothing import check_alpha, smoothing_scales
from autoq.toolkit import bindings, op_name
from models import TARGET, Builder, Runner

SEQ, DIM, HID = 16, 16, 32
#: LayerNorm gamma of this channel is 40x the others (BERT's LN outliers); the dense layers
#: reading it have 40x smaller weights there (so it does not dominate their outputs)
OUTLIER = 5


def block(seed=0):
    """LN1 (outlier gamma) -> dense (weight transposed, as exported) -> gelu -> dense, + LN1
    output (post-LN residual: LN1 has another reader) -> LN2 (outlier gamma) -> dense (a
    (K, N) weight; LN2's only reader: pre-LN style)."""
    b = Builder(seed)
    x = b.input("x", (1, SEQ, DIM))

    def ln(name, y):
        gamma = np.ones(DIM)
        gamma[OUTLIER] = 40.0
        beta = b.rng.normal(size=DIM) * 0.1
        return b.emit(relax.op.nn.layer_norm(y, b.weight(f"{name}.weight", gamma),
                                             b.weight(f"{name}.bias", beta), [-1]))  # fmt: skip

    def dense_t(name, y, n_in, n_out):
        w = b.randw(f"{name}.weight", (n_out, n_in))
        if n_in == DIM:  # reads an LN output: small weights on the outlier channel, as trained
            b.params[f"{name}.weight"][:, OUTLIER] /= 40.0
        out = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(out, b.weight(f"{name}.bias", b.rng.normal(size=n_out) * 0.1)))

    def body(b):
        h = ln("ln1", x)
        f = b.emit(relax.op.nn.gelu(dense_t("ffn.in", h, DIM, HID)))
        h2 = ln("ln2", b.emit(relax.op.add(dense_t("ffn.out", f, HID, DIM), h)))
        head = b.randw("head", (DIM, DIM))
        b.params["head"][OUTLIER] /= 40.0
        return b.emit(relax.op.matmul(h2, head))

    return b.build(body)


def data(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(1, SEQ, DIM)).astype(np.float32) for _ in range(n)]


def test_scales_follow_the_paper():
    s = smoothing_scales(np.array([16.0, 1.0]), np.array([1.0, 4.0]), alpha=0.5)
    assert np.allclose(s, [4.0, 0.5])
    s = smoothing_scales(np.array([16.0]), np.array([4.0]), alpha=0.75)
    assert np.allclose(s, [16.0**0.75 / 4.0**0.25])
    for bad in (0, 1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="smooth_quant"):
            check_alpha(bad)
    with pytest.raises(ValueError, match="smooth_quant"):
        Config(smooth_quant=1.0)
    cfg = Config(smooth_quant=0.6)
    assert Config.loads(cfg.dumps()) == cfg


@pytest.fixture(scope="module")
def smoothed():
    mod, params = block()
    g = match(mod, params, Config(progress=False)).graph
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
    g2 = match(new_mod, new_params, Config(progress=False)).graph
    samples = samples_for(data(8, 1), g2.inputs)
    from autoq.smooth_quant import activation_maxima

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
        cfg = Config(progress=False, check_scales=False, smooth_quant=alpha)
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, data(8, 1))
        run = Runner(res.module)
        sqnr[alpha] = sqnr_db(fp32, [run(x) for x in held])
    # the realized module is the rewritten model's: it equals *that* simulated graph
    sim = simulate(res.matched, None, res.config)
    rep = compare(sim, res.module, res.qparams, samples_for(held[:2], sim.graph.inputs), TARGET)
    assert rep.exact, rep.table()
    assert sqnr[0.5] > sqnr[None] + 8.0, sqnr  # measured 7.9 -> 21.3 dB
