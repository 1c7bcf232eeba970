"""autoq.importers.qoperator: QOperator -> QDQ, as Before/Expected graphs.

Each test writes a small QOperator graph (Before) and, by hand, the QDQ graph the rewrite
must produce (Expected), and compares them node by node: op type, domain, inputs, outputs,
attributes and node names, the initializers' names, dtypes and values, and the graph's
inputs and outputs (:func:`assert_same_graph`, the ONNX analogue of
``tvm.ir.assert_structural_equal``). The generated names are part of the contract
(``<t>/dequantized``, ``<y>/float``, ``<bias>_scale``, ``unit_scale``): split_qdq and the
reports rely on the integer tensors keeping their names.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from autoq.importers import QuantizedImportError, qoperator_to_qdq
from autoq.importers.onnx_graph import INT32_CAST, QOPERATOR_OPS
from autoq.importers.qoperator import TABLE

MS = "com.microsoft"


# ------------------------------------------------------------------------------ helpers


def _init(name, value, dtype):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _vi(name, shape, dtype):
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits, ms=False):
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _node_key(n):
    at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    return (n.op_type, n.domain, list(n.input), list(n.output), at, n.name)


def assert_same_graph(got, expected) -> None:
    """``got`` and ``expected`` (ModelProtos) hold the same graph exactly: nodes in order
    (op type, domain, inputs, outputs, attributes, name), initializers (name, dtype, value,
    in any order), graph inputs and outputs."""
    g, e = got.graph, expected.graph
    got_nodes, want_nodes = [_node_key(n) for n in g.node], [_node_key(n) for n in e.node]
    for k, (a, b) in enumerate(zip(got_nodes, want_nodes, strict=False)):
        assert a == b, f"node {k}: got {a}, expected {b}"
    assert len(got_nodes) == len(want_nodes), (got_nodes, want_nodes)
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    want = {t.name: numpy_helper.to_array(t) for t in e.initializer}
    assert sorted(inits) == sorted(want)
    for name, arr in want.items():
        assert inits[name].dtype == arr.dtype, name
        np.testing.assert_array_equal(inits[name], arr, err_msg=name)
    assert list(g.input) == list(e.input)
    assert list(g.output) == list(e.output)


def _dq(q, s, z=None, axis=None):
    kw = {} if axis is None else {"axis": axis}
    return helper.make_node(
        "DequantizeLinear", [q, s] + ([z] if z else []), [f"{q}/dequantized"], **kw
    )


def _q(y, s, z):
    return helper.make_node("QuantizeLinear", [f"{y}/float", s, z], [y])


# ------------------------------------------------------------------------------- tests


def test_every_qoperator_type_has_a_rule():
    assert set(TABLE) == set(QOPERATOR_OPS)


def _conv_inits():
    return [
        _init("xs", 0.1, np.float32), _init("xz", 128, np.uint8),
        _init("w", np.arange(-6, 6).reshape(3, 2, 1, 2), np.int8),
        _init("ws", [0.01, 0.02, 0.03], np.float32), _init("wz", [0, 0, 0], np.int8),
        _init("ys", 0.2, np.float32), _init("yz", 100, np.uint8),
        _init("b", [7, -8, 9], np.int32),
    ]  # fmt: skip


def _bias_scale():
    """The initializer the rewrite adds for the int32 bias: x_scale * w_scale (float32)."""
    return _init("b_scale", np.float32(0.1) * np.array([0.01, 0.02, 0.03], np.float32), np.float32)


def _expected_conv(name, **attrs):
    """QLinearConv(x, w, b) -> y of _conv_inits in QDQ form."""
    return [
        _dq("x", "xs", "xz"),
        _dq("w", "ws", "wz", axis=0),
        _dq("b", "b_scale", axis=0),
        helper.make_node(
            "Conv", ["x/dequantized", "w/dequantized", "b/dequantized"], ["y/float"], name=name,
            **attrs,
        ),
        _q("y", "ys", "yz"),
    ]  # fmt: skip


def test_qlinearconv_per_channel_with_bias():
    x, y = _vi("x", [1, 2, 4, 4], TP.UINT8), _vi("y", [1, 3, 4, 3], TP.UINT8)
    attrs = {"kernel_shape": [1, 2], "pads": [0, 0, 0, 0]}
    ins = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"]
    before = _model(
        [helper.make_node("QLinearConv", ins, ["y"], name="conv", **attrs)], [x], [y], _conv_inits()
    )
    expected = _model(_expected_conv("conv", **attrs), [x], [y], [*_conv_inits(), _bias_scale()])
    got, counts = qoperator_to_qdq(before)
    assert counts == {"QLinearConv": 1}
    assert_same_graph(got, expected)
    assert len(before.graph.node) == 1  # the caller's model is not modified


def test_qlinearmatmul_per_tensor_constant_rhs():
    inits = [
        _init("as", 0.5, np.float32), _init("az", 3, np.uint8),
        _init("b", np.arange(12).reshape(3, 4) - 6, np.int8), _init("bs", 0.25, np.float32),
        _init("bz", 0, np.int8), _init("ys", 2.0, np.float32), _init("yz", -1, np.int8),
    ]  # fmt: skip
    a, y = _vi("a", [2, 3], TP.UINT8), _vi("y", [2, 4], TP.INT8)
    ins = ["a", "as", "az", "b", "bs", "bz", "ys", "yz"]
    before = _model([helper.make_node("QLinearMatMul", ins, ["y"])], [a], [y], inits)
    nodes = [
        _dq("a", "as", "az"),
        _dq("b", "bs", "bz"),
        helper.make_node(
            "MatMul", ["a/dequantized", "b/dequantized"], ["y/float"], name="QLinearMatMul#0"
        ),
        _q("y", "ys", "yz"),
    ]
    got, _ = qoperator_to_qdq(before)
    assert_same_graph(got, _model(nodes, [a], [y], inits))


def test_matmulinteger_per_column_zero_points_and_convinteger():
    inits = [
        _init("w", np.arange(12).reshape(3, 4) - 6, np.int8), _init("xz", 5, np.uint8),
        _init("wz", [0, 1, -1, 2], np.int8),
        _init("cw", np.arange(8).reshape(4, 2, 1, 1) - 4, np.int8),
    ]  # fmt: skip
    x, c = _vi("x", [2, 3], TP.UINT8), _vi("c", [1, 2, 3, 3], TP.UINT8)
    y, yc = _vi("y", [2, 4], TP.INT32), _vi("yc", [1, 4, 3, 3], TP.INT32)
    before = _model(
        [
            helper.make_node("MatMulInteger", ["x", "w", "xz", "wz"], ["y"]),
            helper.make_node("ConvInteger", ["c", "cw"], ["yc"], name="ci", kernel_shape=[1, 1]),
        ],
        [x, c], [y, yc], inits,
    )  # fmt: skip
    nodes = [
        _dq("x", "unit_scale", "xz"),
        _dq("w", "unit_scales", "wz", axis=1),
        helper.make_node(
            "MatMul", ["x/dequantized", "w/dequantized"], ["y/float"], name="MatMulInteger#0"
        ),
        helper.make_node("Cast", ["y/float"], ["y"], name=f"{INT32_CAST}y", to=TP.INT32),
        _dq("c", "unit_scale_1"),
        _dq("cw", "unit_scale_1"),
        helper.make_node(
            "Conv", ["c/dequantized", "cw/dequantized"], ["yc/float"], name="ci",
            kernel_shape=[1, 1],
        ),
        helper.make_node("Cast", ["yc/float"], ["yc"], name=f"{INT32_CAST}yc", to=TP.INT32),
    ]  # fmt: skip
    units = [
        _init("unit_scale", 1.0, np.float32), _init("unit_scales", np.ones(4), np.float32),
        _init("unit_scale_1", 1.0, np.float32),
    ]  # fmt: skip
    got, counts = qoperator_to_qdq(before)
    assert counts == {"MatMulInteger": 1, "ConvInteger": 1}
    assert_same_graph(got, _model(nodes, [x, c], [y, yc], inits + units))


def _binary_inits():
    return [
        _init("as", 0.1, np.float32), _init("az", 10, np.uint8),
        _init("bs", 0.3, np.float32), _init("bz", 20, np.uint8),
        _init("ys", 0.5, np.float32), _init("yz", 30, np.uint8),
    ]  # fmt: skip


def test_qlinearadd_and_qlinearconcat():
    a, b = _vi("a", [1, 2, 2, 2], TP.UINT8), _vi("b", [1, 2, 2, 2], TP.UINT8)
    s, c = _vi("s", [1, 2, 2, 2], TP.UINT8), _vi("c", [1, 4, 2, 2], TP.UINT8)
    add_in = ["a", "as", "az", "b", "bs", "bz", "ys", "yz"]
    before = _model(
        [
            helper.make_node("QLinearAdd", add_in, ["s"], name="add", domain=MS),
            helper.make_node(
                "QLinearConcat", ["ys", "yz", "a", "as", "az", "s", "ys", "yz"], ["c"],
                name="cat", domain=MS, axis=1,
            ),
        ],
        [a, b], [s, c], _binary_inits(), ms=True,
    )  # fmt: skip
    nodes = [
        _dq("a", "as", "az"),
        _dq("b", "bs", "bz"),
        helper.make_node("Add", ["a/dequantized", "b/dequantized"], ["s/float"], name="add"),
        _q("s", "ys", "yz"),
        _dq("s", "ys", "yz"),
        helper.make_node(
            "Concat", ["a/dequantized", "s/dequantized"], ["c/float"], name="cat", axis=1
        ),
        _q("c", "ys", "yz"),
    ]
    got, counts = qoperator_to_qdq(before)
    assert counts == {"QLinearAdd": 1, "QLinearConcat": 1}
    assert_same_graph(got, _model(nodes, [a, b], [s, c], _binary_inits(), ms=True))


def test_maxpool_between_two_qoperator_nodes_keeps_its_input_qparams():
    x, y = _vi("x", [1, 2, 4, 4], TP.UINT8), _vi("y2", [1, 3, 2, 3], TP.UINT8)
    conv1 = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"]
    conv2 = ["p", "ys", "yz", "w2", "xs", "xz", "ys", "yz"]
    w2 = _init("w2", np.ones((3, 3, 1, 2)), np.uint8)
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    before = _model(
        [
            helper.make_node("QLinearConv", conv1, ["y"], name="c1", kernel_shape=[1, 2]),
            helper.make_node("MaxPool", ["y"], ["p"], name="pool", **pool),
            helper.make_node("QLinearConv", conv2, ["y2"], name="c2", kernel_shape=[1, 2]),
        ],
        [x], [y], [*_conv_inits(), w2],
    )  # fmt: skip
    nodes = [
        *_expected_conv("c1", kernel_shape=[1, 2]),
        _dq("y", "ys", "yz"),
        helper.make_node("MaxPool", ["y/dequantized"], ["p/float"], name="pool", **pool),
        _q("p", "ys", "yz"),
        _dq("p", "ys", "yz"),
        _dq("w2", "xs", "xz"),
        helper.make_node(
            "Conv", ["p/dequantized", "w2/dequantized"], ["y2/float"], name="c2",
            kernel_shape=[1, 2],
        ),
        _q("y2", "ys", "yz"),
    ]  # fmt: skip
    inits = [*_conv_inits(), w2, _bias_scale()]
    got, counts = qoperator_to_qdq(before)
    assert counts == {"QLinearConv": 2}
    assert_same_graph(got, _model(nodes, [x], [y], inits))


def test_requantization_inside_a_qoperator_node_is_an_error():
    """A QLinearAdd output read by the next node with other qparams than it was quantized
    with would need a requantization that the QDQ form cannot express."""
    a, b = _vi("a", [1, 2, 2, 2], TP.UINT8), _vi("b", [1, 2, 2, 2], TP.UINT8)
    y = _vi("y", [1, 2, 2, 2], TP.UINT8)
    before = _model(
        [
            helper.make_node("QLinearAdd", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["s"], domain=MS),
            helper.make_node("QLinearSigmoid", ["s", "as", "az", "ys", "yz"], ["y"], domain=MS),
        ],
        [a, b], [y], _binary_inits(), ms=True,
    )  # fmt: skip
    with pytest.raises(QuantizedImportError, match="requantization inside a QOperator"):
        qoperator_to_qdq(before)
    before.graph.node[1].input[1:3] = ["ys", "yz"]  # the qparams s was quantized with
    got, _ = qoperator_to_qdq(before)
    assert [n.op_type for n in got.graph.node] == [
        "DequantizeLinear", "DequantizeLinear", "Add", "QuantizeLinear", "DequantizeLinear",
        "Sigmoid", "QuantizeLinear",
    ]  # fmt: skip
