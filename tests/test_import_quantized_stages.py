"""autoq.import_quantized as stages: one pattern matching per import, the file's constants
read through Identity chains, and the imported module of a one-QLinearConv file written out
by hand (Before/Expected, ``tvm.ir.assert_structural_equal``).

The small models here are written with onnx.helper; the references are numpy (the expected
integer module is built from the file's own integers and scales) and autoq's import of the
same file written without Identity nodes.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import TensorProto as TP
from onnx import helper, numpy_helper
from tvm import relax

import autoq.ir.matching
from autoq import qnn, realize
from autoq.importers import import_quantized
from autoq.ir.toolkit import const
from models import TARGET, op_sequence


def _init(name, value, dtype):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _vi(name, shape, dtype=TP.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _run(mod, *args):
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return (
        [o.numpy() for o in out] if isinstance(out, tvm.ir.Array | list | tuple) else [out.numpy()]
    )


W = np.array([[[[1, -2]], [[3, 4]]], [[[-5, 6]], [[7, -8]]], [[[9, 10]], [[-11, 12]]]], np.int8)
W_SCALE = np.array([0.01, 0.02, 0.03], np.float32)
BIAS = np.array([70, -80, 90], np.int32)


def qlinearconv_file():
    """One QLinearConv: uint8 input, per-channel int8 weight, int32 bias, uint8 output."""
    inits = [
        _init("xs", 0.1, np.float32), _init("xz", 128, np.uint8), _init("w", W, np.int8),
        _init("ws", W_SCALE, np.float32), _init("wz", [0, 0, 0], np.int8),
        _init("ys", 0.2, np.float32), _init("yz", 100, np.uint8), _init("b", BIAS, np.int32),
    ]  # fmt: skip
    ins = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"]
    node = helper.make_node("QLinearConv", ins, ["y"], name="conv", kernel_shape=[1, 2])
    x, y = _vi("x", [1, 2, 4, 5], TP.UINT8), _vi("y", [1, 3, 4, 4], TP.UINT8)
    return _model([node], [x], [y], inits)


def qdq_file(identity: bool = False):
    """x -> Q/DQ -> conv (int8 weight, int32 bias) -> Q/DQ -> sigmoid (fp32) and a second conv
    whose weight the file keeps in float (a fallback) -> Q/DQ -> add. With ``identity``
    every zero point is ``Identity(initializer)`` and the scales ``Constant`` nodes, as
    torch's FX export writes them."""
    rng = np.random.default_rng(0)
    inits = [
        _init("w_q", W.reshape(3, 2, 1, 2), np.int8),
        _init("b_q", BIAS, np.int32),
        _init("w2", rng.normal(size=(3, 3, 1, 1)), np.float32),
    ]
    nodes = []
    for name, value, dtype in (
        ("s_x", 0.05, np.float32), ("s_w", W_SCALE, np.float32), ("s_b", 0.05 * W_SCALE, np.float32),
        ("s_y", 0.1, np.float32), ("z_x", 3, np.int8), ("z_w", [0, 0, 0], np.int8),
        ("z_y", -5, np.int8),
    ):  # fmt: skip
        if not identity:
            inits.append(_init(name, value, dtype))
        elif name.startswith("s_"):
            tensor = numpy_helper.from_array(np.asarray(value, dtype))
            nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        else:
            inits.append(_init(f"{name}_init", value, dtype))
            nodes.append(helper.make_node("Identity", [f"{name}_init"], [name]))
    nodes += [
        helper.make_node("QuantizeLinear", ["x", "s_x", "z_x"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s_x", "z_x"], ["xd"]),
        helper.make_node("DequantizeLinear", ["w_q", "s_w", "z_w"], ["wd"], axis=0),
        helper.make_node("DequantizeLinear", ["b_q", "s_b"], ["bd"], axis=0),
        helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], kernel_shape=[1, 2]),
        helper.make_node("QuantizeLinear", ["c", "s_y", "z_y"], ["cq"]),
        helper.make_node("DequantizeLinear", ["cq", "s_y", "z_y"], ["cd"]),
        helper.make_node("Sigmoid", ["cd"], ["sg"]),
        helper.make_node("Conv", ["cd", "w2"], ["c2"], kernel_shape=[1, 1]),
        helper.make_node("Add", ["sg", "c2"], ["y"]),
    ]
    return _model(nodes, [_vi("x", [1, 2, 4, 5])], [_vi("y", [1, 3, 4, 4])], inits)


@pytest.fixture
def matcher_calls(monkeypatch):
    calls = []
    real = autoq.ir.matching.match_all

    def counting(g, patterns):
        calls.append(len(patterns))
        return real(g, patterns)

    monkeypatch.setattr(autoq.ir.matching, "match_all", counting)
    return calls


@pytest.mark.parametrize("fmt", ["QDQ", "QOperator"])
def test_one_import_matches_the_patterns_once(matcher_calls, fmt):
    model = qdq_file() if fmt == "QDQ" else qlinearconv_file()
    mod, qparams, report = import_quantized(model)
    assert report.format == fmt
    assert len(matcher_calls) == 1
    if fmt == "QDQ":  # the fallback was decided, and realized, without matching again
        # (conv2d_add: the sigmoid output it adds is not quantized in the file, and so the
        # sigmoid's lookup-table pattern cannot take its output qparams from the file)
        assert report.fallback == {
            "sigmoid_0": "its output is not quantized in the file",
            "w2": "its input sigmoid_0 (not a tensor the model quantizes) is not quantized "
            "in the file",
        }
        assert report.float_ops  # the sigmoid reads the file's rounding of the conv output
    # realize of the report's float model reuses its matches and rounding points
    x = np.random.default_rng(1).normal(size=(1, 2, 4, 5)).astype(np.float32)
    if fmt == "QOperator":
        x = np.random.default_rng(1).integers(0, 256, size=(1, 2, 4, 5)).astype(np.uint8)
    again = realize(report.float_mod, report.params, qparams, report.config)
    assert len(matcher_calls) == 1
    # before the integer input is restored, it is the real value the file dequantizes it to
    xf = x if fmt == "QDQ" else (x.astype(np.float32) - 128) * np.float32(0.1)
    np.testing.assert_array_equal(_run(again, xf)[0], _run(mod, x)[0])


def test_zero_points_through_identity_and_scales_in_constant_nodes_are_constants():
    """torch FX exports zero points as Identity(initializer): they are the constants they
    pass on, not run-time values ("dynamic quantization")."""
    plain_mod, plain_qp, plain_report = import_quantized(qdq_file())
    mod, qp, report = import_quantized(qdq_file(identity=True))
    assert dict(qp) == dict(plain_qp) and set(qp.values) == set(plain_qp.values)
    for k, v in plain_qp.values.items():
        np.testing.assert_array_equal(qp.values[k], v)
    assert report.layers == plain_report.layers and report.fallback == plain_report.fallback
    assert op_sequence(mod) == op_sequence(plain_mod)  # no Identity left over
    x = np.random.default_rng(2).normal(size=(1, 2, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(_run(mod, x)[0], _run(plain_mod, x)[0])


def test_qlinearconv_file_imports_to_the_expected_integer_module():
    """Before: the one-QLinearConv file. Expected, written by hand from the file: qnn.conv2d
    of the uint8 input with the file's int8 weight (scale/zero point as stored), + the file's
    int32 bias, qnn.requantize from the accumulator's scale x_scale * w_scale to the output's
    uint8 qparams. Nothing else: no float op, no run-time quantize."""
    mod, _, report = import_quantized(qlinearconv_file())
    assert report.layers == {"w": "conv2d_bias"} and not report.fallback

    x = relax.Var("x", relax.TensorType([1, 2, 4, 5], "uint8"))
    zeros = np.zeros(3, np.int32)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            acc = bb.emit(
                qnn.conv2d(
                    x, const(W), const(0.1, "float32"), const(128, "int32"), const(W_SCALE),
                    const(zeros), strides=[1, 1], padding=[0, 0, 0, 0], dilation=[1, 1],
                )
            )  # fmt: skip
            acc = bb.emit(relax.op.add(acc, const(BIAS.reshape(1, 3, 1, 1))))
            acc_scale = (np.float32(0.1) * W_SCALE).astype(np.float32)
            y = bb.emit_output(
                qnn.requantize(
                    acc, const(acc_scale), const(zeros), const(0.2, "float32"),
                    const(100, "int32"), axis=1, out_dtype="uint8", rounding="float",
                )
            )  # fmt: skip
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(mod["main"], bb.get()["main"])
