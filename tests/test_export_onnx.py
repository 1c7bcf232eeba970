"""``autoq.export_onnx``: the exported ONNX QDQ model runs in ONNX Runtime and agrees with
autoq's own compiled int8 module (argmax >= 99 %, cosine >= 0.999 per sample) on the bundled
digits CNN and on small CNN / transformer modules; every exact rule (quantize / dequantize,
lookup tables, dynamic quantization, elementwise ops) gives numpy's integers; the bad cases
are one clear error."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from tvm import relax

import autoq
from autoq import primitives as P
from autoq import qnn
from autoq.errors import ExportError
from autoq.export import to_onnx
from autoq.qnn.runtime_qparams import dynamic_quantize
from models import Runner, attention, build_tuple_module, image_data, ln_block, mlp, small_cnn

ort = pytest.importorskip("onnxruntime")


def _session(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _agreement(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(argmax agreement over the last axis, the smallest per-sample cosine)."""
    a, b = ours.reshape(len(ours), -1), theirs.reshape(len(theirs), -1)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float((ours.argmax(-1) == theirs.argmax(-1)).mean()), float(cos.min())


def _check_agrees(result, samples, tmp_path) -> onnx.ModelProto:
    path = autoq.export_onnx(result, tmp_path / "model.onnx")
    model = onnx.load(path)
    sess, vm = _session(model), Runner(result.module)
    name = sess.get_inputs()[0].name
    ours = np.stack([np.asarray(vm(x)) for x in samples])
    theirs = np.stack([sess.run(None, {name: x})[0] for x in samples])
    agree, cos = _agreement(ours, theirs)
    assert agree >= 0.99 and cos >= 0.999, (agree, cos)
    return model


def _ops(model) -> set[str]:
    return {n.op_type for n in model.graph.node}


def test_bundled_digits_model_agrees_in_onnx_runtime(tmp_path):
    from autoq.cli import demo

    mod, params = demo.load_model()
    result = autoq.Quantizer().run(mod, params, demo.calibration_images(32))
    test = [x.reshape(1, 1, 8, 8) for x in demo.load_digits().test_x[:100]]
    model = _check_agrees(result, test, tmp_path)
    assert [i.name for i in model.graph.input] == [mod["main"].params[0].name]
    weights = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    biases = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT32]
    assert len(weights) >= 5 and len(biases) >= 5  # 4 convs + the dense layer
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "Gemm")]
    assert convs and all(len(n.input) == 3 for n in convs)  # the int32 bias is fused in
    per_channel = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.attribute]
    assert per_channel  # per-output-channel weight scales keep their axis


@pytest.mark.parametrize(
    "build, recipe",
    [(small_cnn, None), (mlp, None), (attention, None), (ln_block, "transformer")],
    ids=["small_cnn", "mlp", "attention", "ln_block"],
)
def test_small_modules_agree_in_onnx_runtime(build, recipe, tmp_path):
    mod, params, data = build()
    config = autoq.Config(recipe=recipe) if recipe else None
    result = autoq.Quantizer(config).run(mod, params, data(8))
    _check_agrees(result, data(16, 7), tmp_path)


def test_torch_cnn_with_lookup_tables_agrees(tmp_path):
    from models import torch_cnn

    torch, net = torch_cnn()
    mod, params = autoq.from_torch(net, (torch.randn(1, 3, 16, 16),))
    result = autoq.Quantizer().run(mod, params, image_data((1, 3, 16, 16), 1, 8))
    model = _check_agrees(result, image_data((1, 3, 16, 16), 7, 16), tmp_path)
    assert "Gather" in _ops(model)  # hardswish / sigmoid as exact table lookups


def test_int16_slot_is_int16_quantize_linear(tmp_path):
    mod, params, data = small_cnn()
    spec = autoq.QuantSpec(dtype="int16", calibrator="max")
    config = autoq.Config(overrides=(autoq.Override("block.conv1", activation=spec),))
    result = autoq.Quantizer(config).run(mod, params, data(8))
    model = _check_agrees(result, data(16, 7), tmp_path)
    zero_points = {t.name: t.data_type for t in model.graph.initializer}
    q16 = [
        n
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and zero_points[n.input[2]] == onnx.TensorProto.INT16
    ]
    assert q16


# ------------------------------------------------------------------ rules against numpy


def _run_rule(inputs: dict, body) -> list[np.ndarray]:
    model = to_onnx(build_tuple_module(inputs, body))
    return _session(model).run(None, inputs)


def _c(v, dtype):
    return relax.const(np.asarray(v, dtype))


def test_quantize_and_dequantize_per_axis_are_numpys():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(2, 3, 4)) * 3).astype(np.float32)
    s, z = np.array([0.02, 0.05, 0.1], np.float32), np.array([-3, 0, 7], np.int32)

    def body(x):
        q = qnn.quantize(x, _c(s, "float32"), _c(z, "int32"), axis=1)
        return [q, qnn.dequantize(q, _c(s, "float32"), _c(z, "int32"), axis=1)]

    q, y = _run_rule({"x": x}, body)
    np.testing.assert_array_equal(q, P.quantize(x, s, z, axis=1))
    np.testing.assert_array_equal(y, P.dequantize(P.quantize(x, s, z, axis=1), s, z, axis=1))


def test_lookup_tables_are_exact_per_tensor_and_per_channel():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 3, 5)).astype(np.float32)
    table = rng.integers(-128, 128, 256).astype(np.int8)
    tables = rng.integers(-128, 128, (3, 256)).astype(np.int8)

    def body(x):
        q = qnn.quantize(x, _c(0.01, "float32"), _c(2, "int32"))
        return [q, qnn.lut(q, relax.const(table)), qnn.lut(q, relax.const(tables), axis=1)]

    q, one, per_channel = _run_rule({"x": x}, body)
    idx = q.astype(np.int32) + 128
    np.testing.assert_array_equal(one, table[idx])
    np.testing.assert_array_equal(per_channel, tables[np.arange(3)[None, :, None], idx])


@pytest.mark.parametrize(
    "granularity, dtype, symmetric",
    [("token", "int8", False), ("tensor", "uint8", False), ("token", "int8", True)],
)
def test_dynamic_quantize_gives_the_reference_integers(granularity, dtype, symmetric):
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(1, 6, 16)) * rng.uniform(0.1, 5, (1, 6, 1))).astype(np.float32)
    x[0, 2] = 0.0  # an all-zero row: scale 1

    def body(x):
        t = qnn.dynamic_quantize(x, granularity, dtype, symmetric=symmetric)
        return [relax.TupleGetItem(t, i) for i in range(3)]

    q, s, z = _run_rule({"x": x}, body)
    rq, rs, rz = dynamic_quantize(x, granularity, dtype, symmetric=symmetric)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(np.broadcast_to(s, rs.shape), rs)
    np.testing.assert_array_equal(np.broadcast_to(z, rz.shape), rz)


@pytest.mark.parametrize("op, fn", [("add", np.add), ("subtract", np.subtract),
                                    ("multiply", np.multiply)])  # fmt: skip
def test_elementwise_ops_are_numpys(op, fn):
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(2, 8)).astype(np.float32), rng.normal(size=(2, 8)).astype(np.float32)
    qa, qb, qo = (0.02, -5), (0.03, 4), (0.05, 1)

    def body(a, b):
        x = qnn.quantize(a, _c(qa[0], "float32"), _c(qa[1], "int32"))
        y = qnn.quantize(b, _c(qb[0], "float32"), _c(qb[1], "int32"))
        args = [
            _c(v, t)
            for pair in (qa, qb, qo)
            for v, t in zip(pair, ("float32", "int32"), strict=True)
        ]
        return [getattr(qnn, op)(x, y, *args)]

    (out,) = _run_rule({"a": a, "b": b}, body)
    ra = P.dequantize(P.quantize(a, *qa), *qa)
    rb = P.dequantize(P.quantize(b, *qb), *qb)
    np.testing.assert_array_equal(out, P.quantize(fn(ra, rb), *qo))


def test_conv_bias_requantize_is_within_one_step_of_numpy():
    from models import conv2d_nchw

    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 3, 6, 6)).astype(np.float32)
    w = rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)
    bias = rng.integers(-500, 500, (1, 4, 1, 1)).astype(np.int32)
    sx, sw, sy = np.float32(0.02), rng.uniform(0.001, 0.01, 4).astype(np.float32), 0.1
    sacc = (sx * sw).astype(np.float32)

    def body(x):
        q = qnn.quantize(x, _c(sx, "float32"), _c(0, "int32"))
        acc = qnn.conv2d(q, relax.const(w), _c(sx, "float32"), _c(0, "int32"),
                         relax.const(sw), _c(np.zeros(4), "int32"), padding=(1, 1))  # fmt: skip
        acc = relax.op.add(acc, relax.const(bias))
        return [qnn.requantize(acc, relax.const(sacc), _c(np.zeros(4), "int32"),
                               _c(sy, "float32"), _c(3, "int32"), axis=1)]  # fmt: skip

    (out,) = _run_rule({"x": x}, body)
    q = P.quantize(x, sx, 0).astype(np.int64)
    acc = conv2d_nchw(q, w.astype(np.int64), pad=1) + bias
    ref = P.quantize(P.dequantize(acc, sacc, 0, axis=1), sy, 3)
    diff = np.abs(out.astype(int) - ref.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.99


# ------------------------------------------------------------------ errors and the file


def test_an_op_without_a_rule_is_one_error_naming_the_binding():
    x = np.ones((2, 3), np.float32)
    mod = build_tuple_module({"x": x}, lambda x: [relax.op.cumsum(x, axis=1)])
    with pytest.raises(ExportError, match=r"'relax\.cumsum'.*--format so"):
        to_onnx(mod)


def test_missing_folder_is_an_error_and_nothing_is_written(tmp_path):
    mod, params, data = mlp()
    result = autoq.Quantizer().run(mod, params, data(4))
    with pytest.raises(ExportError, match="does not exist"):
        autoq.export_onnx(result, tmp_path / "missing" / "model.onnx")
    out = autoq.export_onnx(result, tmp_path / "m.onnx", output_names=["logits"])
    assert [o.name for o in onnx.load(out).graph.output] == ["logits"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # no temporary left


def test_openvino_runs_the_exported_digits_model(tmp_path):
    ov = pytest.importorskip("openvino")
    from autoq.cli import demo

    mod, params = demo.load_model()
    result = autoq.Quantizer().run(mod, params, demo.calibration_images(16))
    path = autoq.export_onnx(result, tmp_path / "model.onnx")
    compiled = ov.Core().compile_model(str(path), "CPU")
    test = [x.reshape(1, 1, 8, 8) for x in demo.load_digits().test_x[:32]]
    vm = Runner(result.module)
    ours = np.stack([np.asarray(vm(x)) for x in test])
    theirs = np.stack([compiled(x)[0] for x in test])
    agree, cos = _agreement(ours, theirs)
    assert agree >= 0.99 and cos >= 0.999, (agree, cos)


def test_cli_format_onnx_writes_the_onnx_model_with_the_files_names(tmp_path, capsys):
    from test_cli import tiny_onnx

    from autoq import cli

    model = tiny_onnx(tmp_path / "tiny.onnx")
    x = np.random.default_rng(1).normal(size=(6, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    out = tmp_path / "out"
    argv = ["quantize", model, "--calib", tmp_path / "calib.npz", "--out", out, "--format",
            "onnx", "--no-progress"]  # fmt: skip
    assert cli.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert (out / "model.onnx").is_file() and not (out / "model.so").exists()
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["x"]
    assert [o.name for o in sess.get_outputs()] == ["y"]  # the input file's output name
    import tvm

    saved = tvm.ir.load_json((out / "module.json").read_text())
    vm = Runner(saved)
    ours = np.stack([vm(s[None]) for s in x])
    theirs = np.stack([sess.run(None, {"x": s[None]})[0] for s in x])
    agree, cos = _agreement(ours, theirs)
    assert agree >= 0.99 and cos >= 0.999, (agree, cos)


@pytest.mark.parametrize("method, mode", [("nearest_neighbor", "asymmetric"),
                                          ("linear", "half_pixel")])  # fmt: skip
def test_resize_and_transposed_conv_are_the_onnx_ops(method, mode):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 2, 4, 5)).astype(np.float32)
    w = rng.normal(size=(2, 3, 2, 2)).astype(np.float32)  # IOHW

    def body(x):
        y = relax.op.image.resize2d(x, (8, 10), method=method, rounding_method="floor",
                                    coordinate_transformation_mode=mode)  # fmt: skip
        return [y, relax.op.nn.conv2d_transpose(x, relax.const(w), strides=(2, 2))]

    y, t = _run_rule({"x": x}, body)
    if method == "nearest_neighbor":  # asymmetric, floor: index // 2
        np.testing.assert_array_equal(y, x.repeat(2, axis=2).repeat(2, axis=3))
    else:  # half-pixel bilinear at scale 2: the corners are the input's corners
        assert y.shape == (1, 2, 8, 10) and y[0, 0, 0, 0] == x[0, 0, 0, 0]
    ref = np.zeros((1, 3, 8, 10), np.float32)
    for i in range(4):
        for j in range(5):
            ref[0, :, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2] += np.einsum(
                "c,cokl->okl", x[0, :, i, j], w
            )
    np.testing.assert_allclose(t, ref, rtol=1e-5, atol=1e-5)


def test_mask_ops_comparisons_static_shapes_and_broadcast():
    rng = np.random.default_rng(6)
    a, b = rng.normal(size=(2, 4)).astype(np.float32), rng.normal(size=(2, 4)).astype(np.float32)

    def body(a, b):
        m = relax.op.logical_and(relax.op.less(a, b), relax.op.less(b, relax.const(1.0)))
        n = relax.op.shape_to_tensor(relax.op.shape_of(a))
        wide = relax.op.broadcast_to(relax.op.reshape(a, (1, 2, 4)), (3, 2, 4))
        return [m, n, wide]

    m, n, wide = _run_rule({"a": a, "b": b}, body)
    np.testing.assert_array_equal(m, (a < b) & (b < 1.0))
    np.testing.assert_array_equal(n, [2, 4])
    np.testing.assert_array_equal(wide, np.broadcast_to(a, (3, 2, 4)))


def test_a_transposed_accumulator_dequantizes_to_numpys_product():
    rng = np.random.default_rng(7)
    a, b = (
        rng.normal(size=(1, 4, 8)).astype(np.float32),
        rng.normal(size=(1, 8, 3)).astype(np.float32),
    )
    sa, sb = np.float32(0.02), np.float32(0.03)

    def body(a, b):
        qa = qnn.quantize(a, _c(sa, "float32"), _c(0, "int32"))
        qb = qnn.quantize(b, _c(sb, "float32"), _c(0, "int32"))
        acc = qnn.matmul(qa, qb, _c(sa, "float32"), _c(0, "int32"), _c(sb, "float32"),
                         _c(0, "int32"))  # fmt: skip
        moved = relax.op.permute_dims(acc, [0, 2, 1])
        return [qnn.dequantize(moved, _c(sa * sb, "float32"), _c(0, "int32"))]

    (out,) = _run_rule({"a": a, "b": b}, body)
    acc = P.quantize(a, sa, 0).astype(np.int64) @ P.quantize(b, sb, 0).astype(np.int64)
    ref = P.dequantize(acc.transpose(0, 2, 1), np.float32(sa * sb), 0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_concat_of_int8_tensors_keeps_the_integers():
    x = np.random.default_rng(8).normal(size=(1, 2, 3, 3)).astype(np.float32)

    def body(x):
        q = qnn.quantize(x, _c(0.05, "float32"), _c(-3, "int32"))
        return [relax.op.concat([q, relax.op.nn.max_pool2d(q, (1, 1))], axis=1)]

    (out,) = _run_rule({"x": x}, body)
    q = P.quantize(x, 0.05, -3)
    np.testing.assert_array_equal(out, np.concatenate([q, q], axis=1))


def test_mean_of_a_requantized_tensor_agrees_in_onnx_runtime_and_openvino(tmp_path):
    """A global mean (``qnn.sum`` then a requantize by ``1 / N``) of a requantized uint8
    tensor with a nonzero zero point (MobileNetV3's head): written as ``ReduceMean``, it gives
    numpy's integers in ONNX Runtime and in OpenVINO (OpenVINO 2026.4 computed the former
    ``ReduceSum`` form of it wrongly: every mean at the grid's minimum)."""
    rng = np.random.default_rng(3)
    x = rng.uniform(-0.3, 1.2, (1, 8, 2, 96)).astype(np.float32)
    s1, s2, s3 = np.float32(0.0325), np.float32(0.0316), np.float32(0.0084)
    z, z3, n = 12, 17, 2 * 96

    def body(x):
        q = qnn.quantize(x, _c(s1, "float32"), _c(z, "int32"), out_dtype="uint8")
        q = qnn.requantize(
            q,
            _c(s1, "float32"),
            _c(z, "int32"),
            _c(s2, "float32"),
            _c(z, "int32"),
            out_dtype="uint8",
        )
        acc = qnn.sum(q, _c(s2, "float32"), _c(z, "int32"), axis=[2, 3], keepdims=True)
        mean = qnn.requantize(
            acc,
            _c(s2 / np.float32(n), "float32"),
            _c(0, "int32"),
            _c(s3, "float32"),
            _c(z3, "int32"),
            out_dtype="uint8",
        )
        return [qnn.dequantize(mean, _c(s3, "float32"), _c(z3, "int32"))]

    q = P.requantize(P.quantize(x, s1, z, "uint8"), s1, z, s2, z, "uint8")
    total = (q.astype(np.int32) - z).sum(axis=(2, 3), keepdims=True)
    want = P.dequantize(P.requantize(total, s2 / np.float32(n), 0, s3, z3, "uint8"), s3, z3)
    model = to_onnx(build_tuple_module({"x": x}, body))
    assert "ReduceSum" not in {node.op_type for node in model.graph.node}
    np.testing.assert_array_equal(_session(model).run(None, {"x": x})[0], want)
    ov = pytest.importorskip("openvino")
    onnx.save(model, tmp_path / "mean.onnx")
    compiled = ov.Core().compile_model(str(tmp_path / "mean.onnx"), "CPU")
    np.testing.assert_array_equal(compiled({"x": x})[0], want)


@pytest.mark.parametrize("per_channel_out", [False, True])
def test_depthwise_conv_on_a_per_channel_int8_grid_runs_in_onnx_runtime_and_openvino(
    per_channel_out, tmp_path
):
    """A depthwise conv reading an int8 activation with per-channel scales and zero points
    (the grids of ``depthwise_cnn``), with a per-tensor and a per-channel output grid: its
    input is written as uint8 ``q + 128`` (OpenVINO 2026.4 has no conv kernel for an int8
    input with nonzero zero points and refused to compile PP-OCRv4 det's file) and a
    per-tensor output as int8 (a uint8 one makes ONNX Runtime fuse a ``QLinearConv`` that
    refuses the per-channel input zero point); both runtimes give numpy's integers within
    one step."""
    from models import conv2d_nchw

    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 4, 6, 6)).astype(np.float32)
    w = rng.integers(-127, 128, (4, 1, 3, 3)).astype(np.int8)
    sx = np.array([0.02, 0.01, 0.03, 0.015], np.float32)
    zx = np.array([15, -128, 90, -7], np.int32)
    sw = rng.uniform(0.001, 0.01, 4).astype(np.float32)
    sacc = (sx * sw).astype(np.float32)
    sy = np.array([0.02, 0.03, 0.01, 0.02], np.float32) if per_channel_out else np.float32(0.02)
    zy = np.array([3, -20, 40, 0], np.int32) if per_channel_out else np.int32(3)

    def body(x):
        q = qnn.quantize(x, relax.const(sx), relax.const(zx), axis=1)
        acc = qnn.conv2d(q, relax.const(w), relax.const(sx), relax.const(zx), relax.const(sw),
                         _c(np.zeros(4), "int32"), padding=(1, 1), groups=4)  # fmt: skip
        return [qnn.requantize(acc, relax.const(sacc), _c(np.zeros(4), "int32"),
                               _c(sy, "float32"), _c(zy, "int32"), axis=1)]  # fmt: skip

    q = P.quantize(x, sx, zx, axis=1).astype(np.int64) - zx.reshape(1, 4, 1, 1)
    full = np.zeros((4, 4, 3, 3), np.int64)
    full[np.arange(4), np.arange(4)] = w[:, 0]
    real = P.dequantize(conv2d_nchw(q, full, pad=1), sacc, 0, axis=1)
    ref = P.quantize(real, sy, zy, axis=1 if per_channel_out else None)
    model = to_onnx(build_tuple_module({"x": x}, body))
    outs = {"ORT": _session(model).run(None, {"x": x})[0]}
    ov = pytest.importorskip("openvino")
    onnx.save(model, tmp_path / "dw.onnx")
    outs["OpenVINO"] = ov.Core().compile_model(str(tmp_path / "dw.onnx"), "CPU")({"x": x})[0]
    for name, out in outs.items():
        diff = np.abs(out.astype(int) - ref.astype(int))
        assert diff.max() <= 1 and (diff == 0).mean() >= 0.99, name
