"""benchmarks/ppocr_perchannel_sim.py (the ONNX Runtime QDQ simulation of per-channel
activation scales) and the false-positive crop rule of benchmarks/ppocr_budget.py, against
numpy: the quantized tensors of a tiny conv -> hardswish -> depthwise model, the streaming
percentiles, and the fake-quantized model's output vs a numpy forward pass."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from reference_ops import conv2d_loops

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ppocr_perchannel_sim as pcs  # noqa: E402

RNG = np.random.default_rng(0)
W1 = RNG.normal(size=(4, 3, 3, 3)).astype(np.float32) * 0.5
B1 = RNG.normal(size=4).astype(np.float32)
WD = RNG.normal(size=(4, 1, 3, 3)).astype(np.float32)
W2 = RNG.normal(size=(2, 4, 1, 1)).astype(np.float32)


def _tiny():
    """x -> conv -> *a +b -> hardswish (Add 3, Clip, Mul, Div 6) -> *c +d -> depthwise ->
    relu -> 1x1 conv -> y."""
    from onnx import TensorProto, helper, numpy_helper

    def c(name, v):
        return numpy_helper.from_array(np.asarray(v, np.float32), name)

    inits = [
        c("w1", W1), c("b1", B1), c("a", 1.5), c("b", 0.25), c("three", 3.0), c("zero", 0.0),
        c("six", 6.0), c("cc", 0.8), c("d", -0.1), c("wd", WD), c("w2", W2),
    ]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["a", "c1"], ["m1"]),
        helper.make_node("Add", ["m1", "b"], ["h_in"]),
        helper.make_node("Add", ["h_in", "three"], ["h3"]),
        helper.make_node("Clip", ["h3", "zero", "six"], ["hc"]),
        helper.make_node("Mul", ["h_in", "hc"], ["hm"]),
        helper.make_node("Div", ["hm", "six"], ["h_out"]),
        helper.make_node("Mul", ["cc", "h_out"], ["m2"]),
        helper.make_node("Add", ["m2", "d"], ["dw_in"]),
        helper.make_node("Conv", ["dw_in", "wd"], ["dw"], pads=[1, 1, 1, 1], group=4),
        helper.make_node("Relu", ["dw"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _conv(x, w, b=None, group=1):
    """Stride 1, 'same' padding for odd kernels (the model's convs); numpy reference."""
    kh, kw = w.shape[2:]
    pad = (kh // 2, kw // 2, kh // 2, kw // 2)
    return conv2d_loops(x, w, b, padding=pad, groups=group)


def _fq(x, lo, hi, axis=None):
    s, z = pcs.int8_qparams(lo, hi)
    s, z = s.astype(np.float64), z.astype(np.float64)
    if axis is not None:
        s, z = s[None, :, None, None], z[None, :, None, None]
    q = np.clip(np.round(x / s) + z, -128, 127)
    return (q - z) * s


def _wq(w):
    wc = w.reshape(w.shape[0], -1).astype(np.float64)
    s = np.abs(wc).max(1) / 127.0
    return (np.clip(np.round(wc / s[:, None]), -127, 127) * s[:, None]).reshape(w.shape)


def test_points_and_sets_of_a_conv_hardswish_depthwise_chain():
    points, sets = pcs.quant_points(_tiny())
    # the affines, the hardswish inside and the relu are fused; the output stays float
    assert points == ["x", "h_in", "dw_in", "r"]
    assert sets["chain"] == {"h_in", "dw_in"}
    assert sets["hs_inputs"] == {"h_in"} and sets["dw_inputs"] == {"dw_in"}
    assert sets["conv_inputs"] == {"h_in", "dw_in", "x", "r"}
    assert sets["all"] == set(points) and sets["tensor"] == set()


def test_streaming_percentiles_match_numpy():
    r = pcs.Ranges(bins=4096)
    xs = [
        RNG.normal(size=(1, 3, 20, 20)) * np.array([1, 5, 0.1])[None, :, None, None]
        for _ in range(3)
    ]
    for see in (r.see_range, r.see_values):
        for x in xs:
            see("t", x)
    allx = np.concatenate([x.swapaxes(0, 1).reshape(3, -1) for x in xs], axis=1)
    lo, hi = r.channels("t", 0.99)
    for ch in range(3):
        width = (allx[ch].max() - allx[ch].min()) / 4096
        assert abs(lo[ch] - np.percentile(allx[ch], 1)) <= 2 * width
        assert abs(hi[ch] - np.percentile(allx[ch], 99)) <= 2 * width
    tlo, thi = r.tensor("t", 1.0)
    assert tlo == pytest.approx(allx.min()) and thi == pytest.approx(allx.max())


@pytest.mark.parametrize("arm", ["tensor", "chain", "all"])
def test_fake_quant_model_matches_numpy(arm, tmp_path, monkeypatch):
    monkeypatch.setattr(pcs, "TMP", tmp_path)
    model = _tiny()
    points, sets = pcs.quant_points(model)
    xs = [RNG.normal(size=(1, 3, 6, 6)).astype(np.float32) for _ in range(2)]
    probe = pcs.session(pcs.with_outputs(model, points), "probe")
    r = pcs.Ranges()
    for see in (r.see_range, r.see_values):
        for x in xs:
            for t, v in zip(points, probe.run(points, {"x": x}), strict=True):
                see(t, v)
    sess = pcs.session(pcs.fake_quant_model(model, points, sets[arm], r, 1.0), arm)

    def q(t, v):
        if t in sets[arm]:
            return _fq(v, *r.channels(t, 1.0), axis=1)
        return _fq(v, *r.tensor(t, 1.0))

    for x in xs:
        v = q("x", x.astype(np.float64))
        h = q("h_in", _conv(v, _wq(W1), B1) * 1.5 + 0.25)
        h = h * np.clip(h + 3, 0, 6) / 6 * 0.8 - 0.1
        d = np.maximum(_conv(q("dw_in", h), _wq(WD), group=4), 0)
        want = _conv(q("r", d), _wq(W2))
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_false_positive_rule(monkeypatch):
    import ppocr_budget

    info = SimpleNamespace(name="ppocr_det", extra={"det_size": 32})
    n = 12
    photos = [ppocr_budget.common.CALIB_IMAGES[i % 10] for i in range(n)]
    maps = []
    for i in range(n):
        m = np.zeros((1, 1, 32, 32), np.float32)
        k = 40 + 10 * i  # pixels above 0.3
        m.reshape(-1)[:k] = 0.95 if i % 3 else 0.5  # every third blob is not confident
        maps.append(m)

    class Sess:
        def run(self, _, sample):
            return [maps[calls.index(id(sample))]]

    calls = []
    real = ppocr_budget.common.make_dataset

    def fake_dataset(info_, split, count, seed=None, text=True):
        assert (split, count, text) == ("calib", n, False)
        data = [{"x": np.zeros(1)} for _ in range(count)]
        calls.extend(id(d) for d in data)
        return data

    monkeypatch.setattr(ppocr_budget.common, "make_dataset", fake_dataset)
    chosen, lines = ppocr_budget.false_positive_crops(info, Sess(), n, 2, min_pixels=60)
    monkeypatch.setattr(ppocr_budget.common, "make_dataset", real)
    ok = [
        i
        for i in range(n)
        if i % 3 and 40 + 10 * i >= 60 and photos[i] not in ppocr_budget.FP_EXCLUDED
    ]
    want = sorted(ok, key=lambda i: -(40 + 10 * i))
    assert [int(s.split()[1]) for s in lines] == want
    assert len(chosen) == 2


def test_text_free_crops_are_the_plain_photos():
    pytest.importorskip("rapidocr_onnxruntime")
    import common
    from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess

    info = SimpleNamespace(name="ppocr_det", extra={"det_size": 64})
    got = common.make_dataset(info, "calib", 5, seed=3, text=False)
    cfg = common.ppocr_det_config()
    pre = DetPreProcess(64, "max", cfg.get("mean"), cfg.get("std"))
    for crop, s in zip(common.random_crops(common.CALIB_IMAGES, 5, 3, 64), got, strict=True):
        np.testing.assert_array_equal(s["x"], pre(np.ascontiguousarray(crop[:, :, ::-1])))
    with_text = common.make_dataset(info, "calib", 5, seed=3)
    assert any(not np.array_equal(a["x"], b["x"]) for a, b in zip(got, with_text, strict=True))


def test_bias_correction_removes_the_first_conv_mean_error(tmp_path, monkeypatch):
    from onnx import numpy_helper

    monkeypatch.setattr(pcs, "TMP", tmp_path)
    model = _tiny()
    points, sets = pcs.quant_points(model)
    xs = [{"x": RNG.normal(size=(1, 3, 6, 6)).astype(np.float32)} for _ in range(3)]
    probe = pcs.session(pcs.with_outputs(model, points), "probe")
    r = pcs.Ranges()
    for see in (r.see_range, r.see_values):
        for x in xs:
            for t, v in zip(points, probe.run(points, x), strict=True):
                see(t, v)
    convs = pcs.conv_outputs(model)
    assert convs == ["c1", "dw", "y"]
    fp_means = pcs.channel_means(pcs.session(pcs.with_outputs(model, convs), "fp"), convs, xs)
    for name in convs[:1]:  # numpy: the mean over samples and positions of the fp32 output
        want = np.mean(
            [_conv(x["x"].astype(np.float64), W1, B1).mean(axis=(0, 2, 3)) for x in xs], 0
        )
        np.testing.assert_allclose(fp_means[name], want, rtol=1e-5, atol=1e-5)
    qmodel = pcs.fake_quant_model(model, points, sets["chain"], r, 1.0)
    fixed = pcs.bias_corrected(qmodel, fp_means, xs, 1, "ebc")
    q_c1 = np.mean(
        [
            _conv(_fq(x["x"].astype(np.float64), *r.tensor("x", 1.0)), _wq(W1), B1).mean(
                axis=(0, 2, 3)
            )
            for x in xs
        ],
        0,
    )
    bias = {i.name: numpy_helper.to_array(i) for i in fixed.graph.initializer}
    np.testing.assert_allclose(bias["b1"], B1 - (q_c1 - fp_means["c1"]), rtol=1e-4, atol=1e-5)
    # convs without a bias got one (zeros minus their mean error)
    assert "dw.ebc_bias" in bias and "y.ebc_bias" in bias
    after = pcs.channel_means(pcs.session(pcs.with_outputs(fixed, convs), "after"), convs, xs)
    # one conv a pass: every conv's mean error is zero (its producers were corrected first)
    for name in convs:
        np.testing.assert_allclose(after[name], fp_means[name], atol=1e-4)
