"""Recurrent layers: ONNX LSTM / GRU / RNN unrolled at import (autoq.frontends.recurrent)
match ONNX Runtime fp32, and quantize with cosine >= 0.99 on held-out sequences."""

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import autoq
from autoq.frontends import FrontendError
from models import Runner, run

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

SEQ, BATCH, IN, HID = 3, 2, 6, 8
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _ort(model_bytes, feeds):
    sess = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _outputs(mod, params, feeds):
    out = run(mod, list(feeds.values()), params)
    return out if isinstance(out, list) else [out]


def onnx_node_model(op, seed=0, initial=False, outputs=3, **attrs):
    """One ``op`` node with random weights, X (and with ``initial`` the initial states) as
    inputs; returns (bytes, feeds)."""
    rng = np.random.default_rng(seed)
    nd = 2 if attrs.get("direction") == "bidirectional" else 1
    g = GATES[op] * HID
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.4, (nd, g, IN)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(0, 0.4, (nd, g, HID)).astype(np.float32), "R"),
        numpy_helper.from_array(rng.normal(0, 0.3, (nd, 2 * g)).astype(np.float32), "B"),
    ]
    x_shape, state_shape = [SEQ, BATCH, IN], [nd, BATCH, HID]
    ins = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    feeds = {"X": rng.normal(size=x_shape).astype(np.float32)}
    node_in = ["X", "W", "R", "B", ""]
    if initial:
        node_in.append("h0")
        ins.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, state_shape))
        feeds["h0"] = rng.normal(size=state_shape).astype(np.float32)
        if op == "LSTM":
            node_in.append("c0")
            ins.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, state_shape))
            feeds["c0"] = rng.normal(size=state_shape).astype(np.float32)
    if op == "LSTM" and attrs.pop("peepholes", False):
        node_in += [""] * (7 - len(node_in)) + ["P"]
        inits.append(
            numpy_helper.from_array(rng.normal(0, 0.5, (nd, 3 * HID)).astype(np.float32), "P")
        )
    names = ["Y", "Y_h", "Y_c"][: min(outputs, 3 if op == "LSTM" else 2)]
    node = helper.make_node(op, node_in, names, hidden_size=HID, **attrs)
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names]
    graph = helper.make_graph([node], "rnn", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return model.SerializeToString(), feeds


NODE_CASES = [
    ("LSTM", {"direction": "bidirectional", "initial": True}),
    ("LSTM", {"peepholes": True, "initial": True, "clip": 0.7}),
    ("LSTM", {"input_forget": 1, "layout": 1, "initial": True}),
    ("LSTM", {"direction": "reverse", "activations": ["HardSigmoid", "Relu", "Softsign"]}),
    ("GRU", {"linear_before_reset": 0, "initial": True}),
    ("GRU", {"direction": "reverse", "linear_before_reset": 1, "layout": 1}),
    ("RNN", {"initial": True}),
    ("RNN", {"direction": "bidirectional", "activations": ["Relu", "Tanh"]}),
]


def _batch_first(model, feeds, ref):
    """The same node with ``layout=1`` (ONNX Runtime refuses it, so its reference is the
    layout-0 result transposed); imported without ONNX Runtime's optimizer."""
    m = onnx.load_from_string(model)
    m.graph.node[0].attribute.append(helper.make_attribute("layout", 1))
    for vi in m.graph.input:
        d = vi.type.tensor_type.shape.dim
        d[0].dim_value, d[1].dim_value = d[1].dim_value, d[0].dim_value
    feeds = {k: v.transpose(1, 0, 2) for k, v in feeds.items()}
    ref = [r.transpose(2, 0, 1, 3) if r.ndim == 4 else r.transpose(1, 0, 2) for r in ref]
    return m, feeds, ref


@pytest.mark.parametrize("op,attrs", NODE_CASES, ids=lambda c: str(c))
def test_onnx_node_matches_onnx_runtime(op, attrs):
    attrs = dict(attrs)
    batch_first = attrs.pop("layout", 0)
    model, feeds = onnx_node_model(op, **attrs)
    ref = _ort(model, feeds)
    if batch_first:
        model, feeds, ref = _batch_first(model, feeds, ref)
    mod, params = autoq.from_onnx(model, optimize=not batch_first)
    got = _outputs(mod, params, feeds)
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=2e-6)


class TorchRNN(torch.nn.Module):
    def __init__(self, kind, state=False, **kw):
        super().__init__()
        self.rnn = getattr(torch.nn, kind)(IN, HID, **kw)
        self.state = state

    def forward(self, x, *state):
        y, h = self.rnn(x, *state)
        return (y, h) if self.state else y


def torch_onnx(kind, seed=0, **kw):
    torch.manual_seed(seed)
    m = TorchRNN(kind, **kw).eval()
    x = torch.randn(1, SEQ, IN) if kw.get("batch_first") else torch.randn(SEQ, 1, IN)
    f = io.BytesIO()
    torch.onnx.export(m, (x,), f, input_names=["x"], opset_version=17, dynamo=False)
    return m, f.getvalue(), tuple(x.shape)


TORCH_CASES = [
    ("LSTM", {"num_layers": 2, "bidirectional": True}),
    ("LSTM", {"batch_first": True}),
    ("GRU", {"bidirectional": True}),
    ("RNN", {"num_layers": 2, "nonlinearity": "relu"}),
]


@pytest.mark.parametrize("kind,kw", TORCH_CASES, ids=lambda c: str(c))
def test_torch_exported_onnx_imports_exactly(kind, kw):
    _, model, shape = torch_onnx(kind, **kw)
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    ref = _ort(model, {"x": x})[0]
    mod, params = autoq.from_onnx(model)
    np.testing.assert_allclose(run(mod, [x], params), ref, rtol=1e-5, atol=2e-6)


def _cos(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("kind,kw", [("LSTM", {}), ("GRU", {}), ("RNN", {"bidirectional": True})])
def test_quantized_recurrent_model_is_faithful_on_held_out_sequences(kind, kw):
    _, model, shape = torch_onnx(kind, **kw)
    mod, params = autoq.from_onnx(model)
    rng = np.random.default_rng(0)
    calib = [rng.normal(size=shape).astype(np.float32) for _ in range(8)]
    held_out = [rng.normal(size=shape).astype(np.float32) for _ in range(4)]
    q = autoq.quantize(mod, params, calib, config=autoq.Config(skip_unbounded=False))
    f, r = Runner(mod, params), Runner(q)
    assert all(_cos(r(x), f(x)) >= 0.99 for x in held_out)
    # int8 matmuls (input projection + one per step after the first, per direction) and
    # the gates' sigmoid / tanh as table lookups
    text = q.script()
    directions = 2 if kw.get("bidirectional") else 1
    assert text.count('"qnn.dense"') + text.count('"qnn.matmul"') >= SEQ * directions
    assert text.count('"qnn.lut"') >= SEQ * directions * GATES[kind] // 2


def test_state_in_state_out_model_runs_frame_by_frame():
    """A stateful model (state input, state output: a streaming detector's shape) unrolled
    for one step per call carries its state across calls exactly as ONNX Runtime does."""
    torch.manual_seed(3)
    m = TorchRNN("LSTM", state=True).eval()
    x, h, c = torch.randn(1, 1, IN), torch.zeros(1, 1, HID), torch.zeros(1, 1, HID)
    f = io.BytesIO()
    torch.onnx.export(
        m,
        (x, (h, c)),
        f,
        input_names=["x", "h", "c"],
        output_names=["y", "hn", "cn"],
        opset_version=17,
        dynamo=False,
    )
    mod, params = autoq.from_onnx(f.getvalue())
    sess = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    step = Runner(mod, params)
    rng = np.random.default_rng(0)
    state_ref = state = [np.zeros((1, 1, HID), np.float32)] * 2
    for _ in range(4):
        xt = rng.normal(size=(1, 1, IN)).astype(np.float32)
        y_ref, *state_ref = sess.run(None, {"x": xt, "h": state_ref[0], "c": state_ref[1]})
        y, *state = step(xt, *state)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(state[1], state_ref[1], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_torch_frontend_recurrent_layers_match_torch(kind):
    """torch.nn.LSTM / GRU through from_torch (TVM's torch frontend unrolls them too)."""
    torch.manual_seed(0)
    m = TorchRNN(kind, bidirectional=True, batch_first=True).eval()
    x = torch.randn(1, SEQ, IN)
    mod, params = autoq.from_torch(m, (x,))
    with torch.no_grad():
        ref = m(x).numpy()
    np.testing.assert_allclose(run(mod, [x.numpy()], params), ref, rtol=1e-5, atol=2e-6)


def test_sequence_lens_shorter_than_the_sequence_is_a_clear_error():
    model, _ = onnx_node_model("GRU")
    m = onnx.load_from_string(model)
    m.graph.initializer.append(numpy_helper.from_array(np.array([SEQ, SEQ - 2], np.int32), "lens"))
    m.graph.node[0].input[4] = "lens"
    with pytest.raises(
        FrontendError, match=rf"GRU.*sequence_lens \[{SEQ}, {SEQ - 2}\].*full-length"
    ):
        autoq.from_onnx(m)


def test_non_constant_weights_are_a_clear_error():
    model, _ = onnx_node_model("RNN")
    m = onnx.load_from_string(model)
    r = m.graph.initializer[1]
    m.graph.input.append(helper.make_tensor_value_info("R", TensorProto.FLOAT, list(r.dims)))
    del m.graph.initializer[1]
    with pytest.raises(FrontendError, match=r"RNN.*R input 'R' is not a constant"):
        autoq.from_onnx(m)
