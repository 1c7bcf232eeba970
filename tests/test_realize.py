"""realize(): the canonical integer forms, the allow-list rules, requantize merging,
constants only (no fp32 weights, no run-time quantize of a constant), fidelity."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq import Config, QParam, QuantSpec, calibrate, qnn, realize, simulate
from autoq import primitives as P
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from models import TARGET, Builder, attention, conv, mlp, op_sequence, small_cnn

SYM = QuantSpec(dtype="int8", symmetric=True, calibrator="max")
ASYM = QuantSpec(dtype="int8", symmetric=False, calibrator="max")


def cfg(act=ASYM, **kw):
    return Config(recipe="cnn", activation=act, **kw)


def quantize_all(mod, params, data, config):
    sim = simulate(mod, params, config)
    qp = calibrate(sim, params, data, config, target=TARGET)
    return sim, qp, realize(mod, params, qp, config)


def exact(sim, qp, real, data):
    """Every activation slot's integers in the realized graph equal the simulated ones."""
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    assert rep.exact, rep.table()
    assert set(rep.elements) == set(sim.activation_slots()), set(sim.activation_slots()) - set(
        rep.elements
    )
    return rep


def one_conv_bias():
    b = Builder(0)
    x = b.input("x", (1, 3, 6, 6))
    return b.build(lambda b: conv(b, x, "c", 3, 4))


def test_conv2d_bias_realized_form_is_pinned():
    """quantize -> qnn.conv2d -> add(int32 bias constant) -> dequantize, every constant
    computed here from the qparams with the numpy primitives (round-to-nearest weights)."""
    mod, params = one_conv_bias()
    data = [np.random.default_rng(i).normal(size=(1, 3, 6, 6)).astype(np.float32) for i in range(3)]
    c = cfg(weight_rounding="nearest")
    sim, qp, real = quantize_all(mod, params, data, c)
    xq, wq = qp["x"], qp["c.weight"]
    w_int8 = P.quantize(params["c.weight"], wq.scale, wq.zero_point, axis=0)
    s_acc = (xq.scale * wq.scale).astype(np.float32)
    bias = P.quantize_bias(params["c.bias"], xq.scale, wq.scale).values.reshape(1, 4, 1, 1)
    const = relax.const
    x = relax.Var("x", relax.TensorType([1, 3, 6, 6], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            q = bb.emit(qnn.quantize(x, const(xq.scale), const(xq.zero_point), out_dtype="int8"))
            acc = bb.emit(
                qnn.conv2d(
                    q,
                    const(w_int8),
                    const(xq.scale),
                    const(xq.zero_point),
                    const(wq.scale),
                    const(wq.zero_point),
                    padding=(1, 1, 1, 1),
                )
            )
            acc = bb.emit(relax.op.add(acc, const(bias.astype(np.int32))))
            gv = bb.emit_output(
                qnn.dequantize(acc, const(s_acc), const(np.zeros(4, np.int32)), axis=1)
            )
        bb.emit_func_output(gv)
    tvm.ir.assert_structural_equal(
        real["main"].without_attr("global_symbol"),
        bb.get()["main"].without_attr("global_symbol"),
        map_free_vars=True,
    )
    exact(sim, qp, real, data)


def _core(seq):
    return [op for op, _ in seq]


def test_canonical_forms_of_the_mlp_and_attention():
    mod, params, make = mlp()
    _, _, real = quantize_all(mod, params, make(3), cfg())
    # fc1 + relu: relu's slot starts at 0, so max(q, zp) is the identity and disappears;
    # fc2 + clip(0, 6): the clip's slot is calibrated on its output, so both quantized
    # bounds are the ends of the int8 grid and the clip disappears too (no identity
    # minimum/maximum); fc3 has no bias
    assert op_sequence(real) == [
        ("qnn.quantize", "int8"),
        ("qnn.dense", "int32"), ("add", "int32"), ("qnn.requantize", "int8"),
        ("qnn.dense", "int32"), ("add", "int32"), ("qnn.requantize", "int8"),
        ("qnn.dense", "int32"), ("qnn.dequantize", "float32"),
    ]  # fmt: skip
    mod, params, make = attention()
    _, _, real = quantize_all(mod, params, make(3), cfg())
    seq = op_sequence(real)
    ops = _core(seq)
    assert ops.count("qnn.dense") == 4 and ops.count("qnn.matmul") == 2
    # k^T is transposed on int8; the scores' scaling by a constant is an int8 layer
    # (multiply_const); softmax stays fp32 between dequantize/quantize
    assert ("permute_dims", "int8") in seq
    i = ops.index("nn.softmax")
    assert ops[i - 4 : i + 2] == [
        "qnn.matmul", "qnn.requantize", "qnn.multiply", "qnn.dequantize", "nn.softmax",
        "qnn.quantize",
    ]  # fmt: skip
    # the residual is requantized to int32 at the accumulator's scale and added
    assert ops[-3:] == ["qnn.requantize", "add", "qnn.dequantize"]
    assert seq[-3] == ("qnn.requantize", "int32")


def _op_model(op_fn, shape=(1, 4, 8, 8), cout=4):
    """x -> conv c1 (+bias) -> op -> add(op, op): the add quantizes the op's output, so the
    quantize moves above the op and the op runs on integers."""
    b = Builder(1)
    x = b.input("x", shape)

    def body(b):
        y = conv(b, x, "c1", shape[1], cout)
        z = b.emit(op_fn(b, y))
        return b.emit(relax.op.add(z, z))

    return b.build(body)


ALLOW = {
    "relu": (lambda b, y: relax.op.nn.relu(y), [("maximum", "int8")]),
    # symmetric slot [-0.5, 0.5]: Q(0.5) is qmax (minimum dropped), Q(0) = 0 is not qmin
    "clip": (lambda b, y: relax.op.clip(y, 0.0, 0.5), [("maximum", "int8")]),
    "max_pool2d": (lambda b, y: relax.op.nn.max_pool2d(y, 2, 2), [("nn.max_pool2d", "int8")]),
    "reshape": (lambda b, y: relax.op.reshape(y, [1, 4, 64]), [("reshape", "int8")]),
    "permute_dims": (
        lambda b, y: relax.op.permute_dims(y, [0, 2, 3, 1]),
        [("permute_dims", "int8")],
    ),
    "flatten": (lambda b, y: relax.op.flatten(y), [("flatten", "int8")]),
    "squeeze": (lambda b, y: relax.op.squeeze(y, [0]), [("squeeze", "int8")]),
    "expand_dims": (lambda b, y: relax.op.expand_dims(y, [0]), [("expand_dims", "int8")]),
    "strided_slice": (
        lambda b, y: relax.op.strided_slice(y, [2], [1], [5]),
        [("strided_slice", "int8")],
    ),
    "pad": (lambda b, y: relax.op.nn.pad(y, [0, 0, 0, 0, 1, 1, 1, 1]), [("nn.pad", "int8")]),
    "concat": (
        lambda b, y: relax.op.concat([y, b.emit(relax.op.nn.relu(y))], axis=1),
        [("concat", "int8")],
    ),
    "split": (
        lambda b, y: relax.TupleGetItem(b.emit(relax.op.split(y, 2, axis=1)), 1),
        [("split", ""), ("TupleGetItem", "int8")],
    ),
}


@pytest.mark.parametrize("name", sorted(ALLOW))
def test_allow_list_rule_runs_the_op_on_integers_exactly(name):
    fn, expected = ALLOW[name]
    mod, params = _op_model(fn)
    data = [np.random.default_rng(i).normal(size=(1, 4, 8, 8)).astype(np.float32) for i in range(3)]
    c = cfg(SYM)  # zero point 0: relu is a real max(q, 0), not elided
    sim, qp, real = quantize_all(mod, params, data, c)
    seq = op_sequence(real)
    for item in expected:
        assert item in seq, (name, seq)
    assert (
        "qnn.requantize",
        "int8",
    ) in seq  # conv's accumulator requantized straight to the op's input
    assert ("qnn.add", "int8") in seq
    assert not any(op == "qnn.dequantize" and i < len(seq) - 1 for i, (op, _) in enumerate(seq)), (
        seq
    )
    exact(sim, qp, real, data)


def test_relu_on_a_slot_starting_at_zero_disappears():
    mod, params = _op_model(lambda b, y: relax.op.nn.relu(y))
    data = [np.random.default_rng(i).normal(size=(1, 4, 8, 8)).astype(np.float32) for i in range(3)]
    sim, qp, real = quantize_all(mod, params, data, cfg(ASYM))
    ops = _core(op_sequence(real))
    assert "maximum" not in ops and "nn.relu" not in ops  # zp == qmin: max(q, zp) is the identity
    exact(sim, qp, real, data)


@pytest.mark.parametrize("lo, hi", [(0.0, 0.5), (-0.5, 0.5), (-0.5, 0.0)])
def test_clip_bounds_are_quantized_with_the_slot_qparams(lo, hi):
    """Each side of a clip runs on int8 with its bound quantized on the slot's grid, and is
    dropped when that bound is an end of the grid (the identity on every int8 value)."""
    mod, params = _op_model(lambda b, y: relax.op.clip(y, lo, hi))
    data = [np.random.default_rng(i).normal(size=(1, 4, 8, 8)).astype(np.float32) for i in range(3)]
    sim, qp, real = quantize_all(mod, params, data, cfg(SYM))
    slot = qp["clip_0"]
    consts = {}
    for b in real["main"].body.blocks[0].bindings:
        if isinstance(b.value, tvm.ir.Call) and b.value.op.name in (
            "relax.minimum",
            "relax.maximum",
        ):
            consts[b.value.op.name] = int(b.value.args[1].value.numpy())
    q_hi = int(P.quantize(hi, slot.scale, slot.zero_point))
    q_lo = int(P.quantize(lo, slot.scale, slot.zero_point))
    expected = {}
    if q_hi < 127:
        expected["relax.minimum"] = q_hi
    if q_lo > -128:
        expected["relax.maximum"] = q_lo
    assert consts == expected
    assert (lo, hi) == (-0.5, 0.5) or expected  # the one-sided clips keep their inner side
    exact(sim, qp, real, data)


def test_equal_qparams_drop_the_requantize():
    """add -> reshape -> add: the reshape's slot sees the same values as the add's output,
    so its qparams are equal and no requantize is left between them."""
    b = Builder(2)
    x = b.input("x", (1, 8))

    def body(b):
        s = b.emit(relax.op.add(x, x))
        r = b.emit(relax.op.reshape(s, [2, 4]))
        return b.emit(relax.op.add(r, r))

    mod, params = b.build(body)
    data = [np.random.default_rng(i).normal(size=(1, 8)).astype(np.float32) for i in range(3)]
    sim, qp, real = quantize_all(mod, params, data, cfg())
    assert qp["add_0"] == qp["reshape_0"]
    assert _core(op_sequence(real)) == [
        "qnn.quantize",
        "qnn.add",
        "reshape",
        "qnn.add",
        "qnn.dequantize",
    ]
    exact(sim, qp, real, data)


def _float_constants(mod):
    out = []

    def visit(e, where):
        if isinstance(e, tvm.ir.GenericConst):
            out.append((where, e.value.numpy()))

    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, tvm.ir.Call):
                for i, a in enumerate(v.args):
                    visit(a, (v.op.name, i))
    return out


def test_no_fp32_weights_and_no_quantize_of_a_constant():
    mod, params, make = small_cnn()
    _, _, real = quantize_all(mod, params, make(3), Config(recipe="cnn"))
    weights = {n: a for n, a in params.items() if n.endswith(".weight")}
    for (op, i), value in _float_constants(real):
        if value.dtype == np.float32:
            # float constants only as scales of qnn ops (never a weight tensor)
            assert op.startswith("qnn.") and value.ndim <= 1, (op, i, value.shape)
            assert all(value.size != w.size or value.size == w.shape[0] for w in weights.values())
        if op == "qnn.quantize":
            assert i != 0, "quantize of a constant"
    int8_weights = [
        v for (op, i), v in _float_constants(real) if op in ("qnn.conv2d", "qnn.dense") and i == 1
    ]
    assert len(int8_weights) == 5 and all(w.dtype == np.int8 for w in int8_weights)
    # main takes only the model input
    assert [p.name for p in real["main"].params] == ["x"]


def test_fallback_layer_runs_fp32_between_dequantize_and_quantize():
    mod, params, make = small_cnn()
    data = make(3)
    c = Config(recipe="cnn", fallback=__import__("autoq").Fallback(ids=("block.conv1",)))
    sim, qp, real = quantize_all(mod, params, data, c)
    seq = op_sequence(real)
    assert ("nn.conv2d", "float32") in seq
    assert _core(seq).count("qnn.conv2d") == 3
    i = _core(seq).index("nn.conv2d")
    assert "qnn.dequantize" in _core(seq)[:i]
    exact(sim, qp, real, data)


@pytest.mark.parametrize(
    "rounding", ["half_even", "half_away", "half_up", "tflite", "tflite_single"]
)
def test_integer_rounding_modes_differ_by_at_most_one_lsb(rounding):
    mod, params, make = small_cnn()
    data = make(3)
    c = Config(recipe="cnn", rounding=rounding)
    sim, qp, real = quantize_all(mod, params, data, c)
    ops = op_sequence(real)
    assert ("qnn.requantize", "int8") in ops
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    # the first requantize sees identical inputs in both graphs: at most 1 LSB apart;
    # later slots inherit upstream differences, still rare and small
    assert rep.max_lsb["relu_0"] <= 1, rep.table()
    modes = {
        str(b.value.attrs["rounding"])
        for b in real["main"].body.blocks[0].bindings
        if isinstance(b.value, tvm.ir.Call) and b.value.op.name == "qnn.requantize"
    }
    assert modes == {rounding}
    assert rep.total_differing < 0.05 * sum(rep.elements.values()), rep.table()
    assert max(rep.max_lsb.values()) <= 3, rep.table()


def test_realize_with_qparams_of_another_model_is_a_clear_error():
    mod, params, make = small_cnn()
    qp = calibrate(simulate(mod, params, cfg()), params, make(2), cfg(), target=TARGET)
    broken = qp.replace(x=QParam(np.float32(0.1), np.int32(0)))
    del broken.params["fc.weight"]
    with pytest.raises(KeyError, match=r"no qparams for slot 'fc.weight' \(layer fc\)"):
        realize(mod, params, broken, cfg())
