"""Dynamic quantization (autoq.realization.dynamic): ``qnn.dynamic_quantize`` against its numpy
reference (autoq.qnn.runtime_qparams) bit for bit, whole models against an independent numpy
reimplementation of the same scheme, ONNX Runtime's DynamicQuantizeLinear, the transformer
block, the JSON round trip and the configuration errors."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from tvm import relax

import autoq
from autoq import Config, Fallback, Override, QuantSpec, qnn
from autoq import primitives as P
from autoq.config import AutoFallback
from autoq.qnn import QnnError
from autoq.qnn import runtime_qparams as R
from models import Runner, attention, mlp, run, run_tuple

DYN = QuantSpec(dynamic=True)
TOKEN = QuantSpec(dynamic=True, granularity="token")


def test_doctests():
    assert doctest.testmod(R).failed == 0


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 3, 16)) * rng.uniform(0.1, 5, (2, 3, 1))).astype(np.float32)
    x[0, 1] = 0.0  # an all-zero token: scale 1, never a division by zero
    x[1, 2] = np.abs(x[1, 2])  # a positive-only token: range widened to 0
    return x


SPECS = [
    ("tensor", "int8", {}),
    ("token", "int8", {}),
    ("token", "uint8", {}),
    ("tensor", "int8", {"symmetric": True, "narrow_range": True}),
    ("token", "uint8", {"symmetric": True}),
    ("token", "int8", {"reduce_range": True}),
]


@pytest.mark.parametrize("gran,dtype,opts", SPECS)
def test_op_matches_reference(gran, dtype, opts):
    x = _data()

    def body(x):
        t = qnn.dynamic_quantize(x, gran, dtype, **opts)
        return [relax.TupleGetItem(t, i) for i in range(3)]

    q, s, z = run_tuple({"x": x}, body)
    rq, rs, rz = R.dynamic_quantize(x, gran, dtype, **opts)
    assert q.dtype == np.dtype(dtype) and s.shape == rs.shape and z.shape == rz.shape
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(z, rz)
    np.testing.assert_array_equal(q, rq)
    # and the dequantized values are within half a step of the input
    err = np.abs((q.astype(np.float32) - z) * s - x)
    assert np.all(err <= s * 0.5 + 1e-7)


def test_reference_matches_onnx_dynamic_quantize_linear():
    """uint8 asymmetric per tensor is ONNX DynamicQuantizeLinear (run by ONNX Runtime)."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3, 16]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("z", TensorProto.UINT8, []),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for seed in range(3):
        x = _data(seed)
        y, s, z = sess.run(None, {"x": x})
        q, rs, rz = R.dynamic_quantize(x, "tensor", "uint8")
        assert float(s) == float(rs) and int(z) == int(rz)
        np.testing.assert_array_equal(y, q)
    del onnx


def _weight_q(w):
    """The default weight spec in numpy: symmetric int8, narrow range, per output channel
    (w is [N, K])."""
    s, _ = P.choose_qparams(w.min(axis=1), w.max(axis=1), symmetric=True, narrow_range=True)
    return P.quantize(w, s, 0, "int8", axis=0), s


def _mlp_reference(params, x, spec: QuantSpec):
    opts = {"dtype": spec.dtype, "symmetric": spec.symmetric}

    def dense(name, y, bias=True):
        wq, ws = _weight_q(params[f"{name}.weight"])
        b = params[f"{name}.bias"] if bias else None
        return R.dynamic_dense(y, wq, ws, b, spec.granularity, **opts)

    y = np.maximum(dense("fc1", x), np.float32(0))
    y = np.clip(dense("fc2", y), np.float32(0), np.float32(6))
    return dense("fc3", y, bias=False)


@pytest.mark.parametrize("spec", [DYN, TOKEN, QuantSpec(dynamic=True, dtype="uint8")])
def test_mlp_bit_exact_without_data(spec):
    mod, params, data = mlp()
    res = autoq.Quantizer(Config(recipe="cnn", activation=spec)).run(mod, params, None)
    assert res.int8_layers == ["fc1", "fc2", "fc3"] and res.fp32_layers == {}
    text = res.module["main"].script()
    assert text.count('"qnn.dense"') == 3 and text.count('"qnn.dynamic_quantize"') == 3
    run_q = Runner(res.module)
    for x in data(3, seed=5):
        np.testing.assert_array_equal(run_q(x), _mlp_reference(params, x, spec))
    fp = run(mod, [x], params)
    assert np.abs(run_q(x) - fp).max() < 0.05 * np.abs(fp).max()


@pytest.mark.parametrize("gran", ["tensor", "token"])
def test_transformer_block(gran):
    """q/k/v/out projections int8 with run-time scales (one dynamic_quantize shared by
    q, k and v), the attention matmuls fp32; the projections match numpy bit for bit."""
    mod, params, data = attention()
    cfg = Config(recipe="cnn", activation=QuantSpec(dynamic=True, granularity=gran))
    res = autoq.Quantizer(cfg).run(mod, params, None)
    assert res.int8_layers == ["attn.q", "attn.k", "attn.v", "attn.out"]
    assert set(res.fp32_layers.values()) == {autoq.realization.dynamic.NO_DYNAMIC_FORM}
    text = res.module["main"].script()
    assert text.count('"qnn.dynamic_quantize"') == 2 and text.count('"qnn.dense"') == 4
    x = data(1, seed=3)[0]

    def dense(name, y):
        wq, ws = _weight_q(params[f"{name}.weight"])
        return R.dynamic_dense(y, wq, ws, params[f"{name}.bias"], gran)

    q, k, v = (dense(f"attn.{n}", x) for n in "qkv")
    s = (q @ k.transpose(0, 2, 1)) * np.float32(0.25)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    want = dense("attn.out", (p @ v).astype(np.float32)) + x
    got = Runner(res.module)(x)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)
    fp = run(mod, [x], params)
    assert np.abs(got - fp).max() < 0.05 * np.abs(fp).max()


def test_override_granularity_and_fallback():
    mod, params, _ = mlp()
    cfg = Config(
        recipe="cnn",
        activation=DYN,
        overrides=(Override("fc2", activation=TOKEN),),
        fallback=Fallback(ids=("fc3",)),
    )
    res = autoq.Quantizer(cfg).run(mod, params, None)
    assert res.int8_layers == ["fc1", "fc2"] and res.fp32_layers == {"fc3": "fallback rule"}
    text = res.module["main"].script()
    assert '"granularity": "token"' in text and '"granularity": "tensor"' in text


def test_json_round_trip():
    cfg = Config(
        recipe="cnn",
        activation=TOKEN,
        overrides=(Override("fc*", activation=QuantSpec(dynamic=True, dtype="uint8")),),
    )
    back = Config.from_json(cfg.to_json())
    assert back == cfg and back.activation.granularity == "token"
    assert back.overrides[0].activation.dynamic
    # documents written before dynamic quantization existed still load (static)
    d = Config(recipe="cnn").to_json()
    del d["activation"]["dynamic"], d["activation"]["granularity"]
    assert not Config.from_json(d).activation.dynamic


CONFIG_ERRORS = [
    (lambda: QuantSpec(granularity="token"), "needs dynamic=True"),
    (lambda: QuantSpec(dynamic=True, granularity="row"), "granularity must be one of"),
    (lambda: QuantSpec(dynamic=True, dtype="int16"), "int8 or uint8"),
    (lambda: QuantSpec(dynamic=True, per_channel=True), "never per channel"),
    (lambda: QuantSpec(dynamic="yes"), "QuantSpec.dynamic must be a bool"),
    (
        lambda: Config(recipe="cnn", weight=QuantSpec(dynamic=True)),
        "weights are always quantized statically",
    ),
    (
        lambda: Config(
            recipe="cnn", activation=DYN, overrides=(Override("fc1", activation=QuantSpec()),)
        ),
        "a dynamic model has no calibration",
    ),
    (
        lambda: Config(recipe="cnn", activation=DYN, fallback=AutoFallback()),
        "AutoFallback needs calibration",
    ),
    (lambda: Config(recipe="cnn", activation=DYN, int8_outputs=True), "int8_outputs"),
]


@pytest.mark.parametrize("make,fragment", CONFIG_ERRORS)
def test_config_errors(make, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        make()


def test_override_must_match_a_dynamic_layer():
    mod, params, _ = attention()
    cfg = Config(recipe="cnn", activation=DYN, overrides=(Override("matmul_3", activation=TOKEN),))
    with pytest.raises(ValueError, match="matches no quantized layer"):
        autoq.Quantizer(cfg).run(mod, params, None)


def test_op_errors():
    x = {"x": np.zeros((2, 3), np.float32)}
    with pytest.raises(QnnError, match="granularity"):
        run_tuple(x, lambda x: [relax.TupleGetItem(qnn.dynamic_quantize(x, "row"), 0)])
    with pytest.raises(QnnError, match="out_dtype"):
        run_tuple(x, lambda x: [relax.TupleGetItem(qnn.dynamic_quantize(x, "token", "int16"), 0)])
    q = {"q": np.zeros((2, 3), np.int8), "w": np.zeros((4, 3), np.int8)}

    def bad_rows(q, w):
        s = relax.const(np.ones((3, 1), np.float32))
        z = relax.const(np.zeros((3, 1), np.int32))
        one, zero = relax.const(np.float32(1)), relax.const(np.int32(0))
        return [qnn.dense(q, w, s, z, one, zero)]

    with pytest.raises(QnnError, match="per row of shape"):
        run_tuple(q, bad_rows)
