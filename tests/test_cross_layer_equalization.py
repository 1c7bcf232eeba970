"""autoq.cross_layer_equalization (Config.equalization): Before / Expected modules built by
hand (tvm.ir.assert_structural_equal), the float function unchanged (TVM fp32 before/after),
the ranges equalized, chains it must not touch (ReLU6, a value with two users, a shared
weight) left exactly as they were, and the option validated and wired into the pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq import Config, Quantizer
from autoq.cross_layer_equalization import equalize_layers
from autoq.equalize import input_channel_ranges, output_channel_ranges
from models import Builder, Runner, image_data, two_convs

F32 = "float32"

# hand-made pair: W1's output-channel ranges [4, 1, 2], W2's input-channel ranges [1, 4, 2],
# so DFQ's s = sqrt(r1 r2) / r2 = [2, 0.5, 1] and both become [2, 2, 2]
W1 = np.array([4.0, -1.0, 2.0], np.float32).reshape(3, 1, 1, 1) * np.ones((3, 2, 3, 3), np.float32)
W1[:, 1] *= -0.5
B1 = np.array([0.4, -0.3, 0.2], np.float32)
W2 = np.array([[1.0, 4.0, -2.0], [-0.5, 2.0, 1.0]], np.float32).reshape(2, 3, 1, 1)
S = np.array([2.0, 0.5, 1.0], np.float32)


def _const_module(w1, b1, w2, act=relax.op.nn.relu) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 2, 5, 5], F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w1), padding=1))
            y = bb.emit(relax.op.add(y, relax.const(b1.reshape(1, 3, 1, 1))))
            y = bb.emit(act(y))
            gv = bb.emit_output(relax.op.nn.conv2d(y, relax.const(w2)))
        bb.emit_func_output(gv)
    return bb.get()


def test_constant_weights_before_expected():
    before = _const_module(W1, B1, W2)
    expected = _const_module(W1 / S.reshape(3, 1, 1, 1), B1 / S, W2 * S.reshape(1, 3, 1, 1))
    out, params, report = equalize_layers(before, None)
    tvm.ir.assert_structural_equal(out["main"], expected["main"])
    assert params == {}
    assert report.pairs == (("lv", "gv", "relu"),)  # constants: named by their bindings


def _param_model(seed=0, act="relu", residual=False):
    """x -> conv a (+ bias) -> act -> conv b (+ bias), with named parameters."""
    b = Builder(seed)
    x = b.input("x", (1, 2, 5, 5))

    def body(b):
        wa = b.weight("a.weight", W1)
        y = b.emit(relax.op.nn.conv2d(x, wa, padding=1))
        y = b.emit(relax.op.add(y, relax.op.reshape(b.weight("a.bias", B1), [1, 3, 1, 1])))
        if act == "relu":
            y = b.emit(relax.op.nn.relu(y))
        elif act == "relu6":
            y = b.emit(relax.op.clip(y, 0, 6))
        z = b.emit(relax.op.nn.conv2d(y, b.weight("b.weight", W2)))
        if residual:  # y is read twice: by conv b and by this add
            return b.emit(relax.op.add(b.emit(relax.op.mean(z, axis=[1], keepdims=True)), y))
        return z

    return b.build(body)


def test_parameters_rescaled_structure_kept():
    mod, params = _param_model()
    out, new, report = equalize_layers(mod, params)
    tvm.ir.assert_structural_equal(out["main"], mod["main"])
    np.testing.assert_array_equal(new["a.weight"], W1 / S.reshape(3, 1, 1, 1))
    np.testing.assert_array_equal(new["a.bias"], B1 / S)
    np.testing.assert_array_equal(new["b.weight"], W2 * S.reshape(1, 3, 1, 1))
    np.testing.assert_array_equal(params["a.weight"], W1)  # the input is not modified
    assert report.chains == (("a.weight", "b.weight"),)


@pytest.mark.parametrize(
    "kind, reason",
    [
        ({"act": "relu6"}, "clip between the layers (not positively homogeneous)"),
        ({"residual": True}, "2 users (add, nn.conv2d)"),
    ],
    ids=["relu6", "two_users"],
)
def test_chains_it_must_not_touch_are_left_exactly(kind, reason):
    mod, params = _param_model(**kind)
    out, new, report = equalize_layers(mod, params)
    tvm.ir.assert_structural_equal(out["main"], mod["main"])
    assert new.keys() == params.keys()
    for k in params:
        np.testing.assert_array_equal(new[k], params[k])
    assert report.pairs == ()
    assert report.skipped == (("a.weight", reason),)


def test_shared_weight_is_left_alone():
    """conv(x, W) -> relu -> conv(., W): rescaling W's rows and columns would not commute."""
    b = Builder(0)
    x = b.input("x", (1, 2, 5, 5))

    def body(b):
        w = b.weight("w", W1[:2])
        y = b.emit(relax.op.nn.relu(b.emit(relax.op.nn.conv2d(x, w, padding=1))))
        return b.emit(relax.op.nn.conv2d(y, w, padding=1))

    mod, params = b.build(body)
    out, new, report = equalize_layers(mod, params)
    assert out is mod and report.pairs == ()
    np.testing.assert_array_equal(new["w"], params["w"])


def _chain_model(seed=0):
    """conv 3x3 (+b) -> relu -> depthwise 3x3 (+b) -> relu -> conv 1x1 (+b) -> conv 3x3:
    weights with per-channel magnitudes spread over four decades."""
    b = Builder(seed)
    x = b.input("x", (1, 3, 9, 9))

    def w(name, shape):
        mags = 10.0 ** b.rng.uniform(-2, 2, size=(shape[0],) + (1,) * (len(shape) - 1))
        return b.weight(name, b.rng.normal(size=shape) * mags)

    def bias(y, name, c):
        return b.emit(
            relax.op.add(y, relax.op.reshape(b.weight(name, b.rng.normal(size=c)), [1, c, 1, 1]))
        )

    def body(b):
        y = b.emit(relax.op.nn.conv2d(x, w("c1.weight", (8, 3, 3, 3)), padding=1))
        y = b.emit(relax.op.nn.relu(bias(y, "c1.bias", 8)))
        y = b.emit(relax.op.nn.conv2d(y, w("dw.weight", (8, 1, 3, 3)), padding=1, groups=8))
        y = b.emit(relax.op.nn.relu(bias(y, "dw.bias", 8)))
        y = bias(b.emit(relax.op.nn.conv2d(y, w("pw.weight", (4, 8, 1, 1)))), "pw.bias", 4)
        return b.emit(relax.op.nn.conv2d(y, w("c4.weight", (6, 4, 3, 3)), padding=1))

    return b.build(body)


def test_float_function_is_preserved_and_ranges_equalized():
    mod, params = _chain_model()
    out, new, report = equalize_layers(mod, params)
    assert report.pairs == (
        ("c1.weight", "dw.weight", "relu"),
        ("dw.weight", "pw.weight", "relu"),
        ("pw.weight", "c4.weight", "none"),
    )
    assert report.chains == (("c1.weight", "dw.weight", "pw.weight", "c4.weight"),)
    names = ["c1.weight", "dw.weight", "pw.weight", "c4.weight"]
    groups = [1, 8, 1, 1]
    for k in range(3):
        r1 = output_channel_ranges(new[names[k]])
        r2 = input_channel_ranges(new[names[k + 1]], groups[k + 1])
        np.testing.assert_allclose(r1, r2, rtol=1e-4)
        assert not np.allclose(new[names[k]], params[names[k]])
    xs = image_data((1, 3, 9, 9), seed=3, n=3)
    ref, got = Runner(mod, params), Runner(out, new)
    for x in xs:
        a, e = ref(x), got(x)
        np.testing.assert_allclose(e, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def test_config_option_validated_and_round_trips():
    assert Config().equalization is False
    cfg = Config(equalization=True)
    assert Config.loads(cfg.dumps()) == cfg
    with pytest.raises(TypeError, match=r"Config\.equalization must be True or False"):
        Config(equalization="yes")


def test_pipeline_equalizes_before_calibration():
    """Named parameters and the same weights bound as constants (params=None: the constants
    are rescaled in place) give the same int8 model."""
    mod, params, data = two_convs()
    cfg = Config(progress=False, weight_rounding="nearest", equalization=True)
    res = Quantizer(cfg).run(mod, params, data(8, 1))
    assert res.equalization.pairs == (("c1.weight", "c2.weight", "relu"),)
    assert "equalize" in res.timings
    assert res.int8_layers == ["c1", "c2"]
    # the int8 weights are those of the equalized float model: c1's channel ranges equal
    _, eq, _ = equalize_layers(mod, params)
    w = res.qparams["c1.weight"]
    np.testing.assert_allclose(w.scale * 127, output_channel_ranges(eq["c1.weight"]), rtol=1e-6)
    x = data(1, 7)[0]
    fp32, int8 = Runner(mod, params)(x), Runner(res.module)(x)
    cos = float((fp32 * int8).sum() / np.linalg.norm(fp32) / np.linalg.norm(int8))
    assert cos > 0.99
    bound = Quantizer(cfg).run(relax.transform.BindParams("main", params)(mod), None, data(8, 1))
    assert len(bound.equalization.pairs) == 1
    np.testing.assert_allclose(Runner(bound.module)(x), int8, rtol=1e-5)
