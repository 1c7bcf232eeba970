"""Integer-only activations: the lookup tables (numpy, against independent float64 references),
the ``qnn.lut`` op, and every activation end to end (realized graph = simulated graph bit for
bit, no float op between the input quantize and the output dequantize, close to fp32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

import autoq
from autoq import Config, QParam, QParams, qnn, realize, simulate
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from autoq.ir.activations import ACTIVATIONS, lut_table
from autoq.ir.canonicalize import hardsigmoid, hardswish
from autoq.qnn import QnnError
from models import TARGET, Builder, Runner

F32 = "float32"
NAMES = [a.name for a in ACTIVATIONS.values()]


def test_golden_tables():
    """sigmoid on input scale 1/16 (zp 0) to output scale 1/256 (zp -128): entry q is
    round(256 * sigmoid(q / 16)) - 128; q = 0 -> 0, q = 16 (x = 1) -> round(187.14) - 128 = 59,
    q = -128 (x = -8) -> round(0.0859) - 128 = -128."""
    t = lut_table("sigmoid", 1 / 16, 0, "int8", 1 / 256, -128, "int8")
    assert (int(t[128]), int(t[128 + 16]), int(t[0])) == (0, 59, -128)
    # hardswish on uint8 input (zp 128, scale 0.05) to int8 output (scale 0.05, zp 0):
    # x = -3.2 (q 64) -> 0; x = 1.0 (q 148) -> 1 * 4 / 6 = 0.667 -> 13; x = 6.35 -> 6.35 -> 127
    t = lut_table("hardswish", 0.05, 128, "uint8", 0.05, 0, "int8")
    assert (int(t[64]), int(t[148]), int(t[255])) == (0, 13, 127)


REFERENCE = {
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "tanh": np.tanh,
    "hardswish": lambda x: x * np.minimum(np.maximum(x + 3, 0), 6) / 6,
    "hardsigmoid": lambda x: np.minimum(np.maximum(x + 3, 0), 6) / 6,
    "silu": lambda x: x / (1 + np.exp(-x)),
    "gelu": lambda x: np.array([v * (1 + math.erf(v / math.sqrt(2))) / 2 for v in x.ravel()]),
    "gelu_tanh": lambda x: x / (1 + np.exp(-2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
}


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(
    s_in=st.floats(0.005, 0.2),
    zp_in=st.integers(-128, 127),
    s_out=st.floats(0.002, 0.05),
    zp_out=st.integers(-128, 127),
)
def test_tables_round_the_reference_function(name, s_in, zp_in, s_out, zp_out):
    """Every entry is the reference function's value on the input grid, rounded to the
    output grid (within the float64 evaluation's error of a tie) and clipped."""
    t = lut_table(name, s_in, zp_in, "int8", s_out, zp_out, "int8").astype(np.int64)
    x = (np.arange(-128, 128) - zp_in).astype(np.float32) * np.float32(s_in)
    exact = np.asarray(REFERENCE[name](x.astype(np.float64)), np.float64) / s_out + zp_out
    assert np.all(np.abs(t - np.clip(exact, -128, 127)) <= 0.5 + 1e-4)


def test_lut_op_checks_its_table():
    x = relax.Var("x", relax.TensorType([4], "int8"))
    with pytest.raises(QnnError, match=r"qnn.lut: argument 'table' must be a 1-D tensor of 256"):
        relax.BlockBuilder().normalize(qnn.lut(x, relax.const(np.zeros(255, np.int8))))
    with pytest.raises(QnnError, match=r"argument 'data' must be of dtype int8 or uint8"):
        y = relax.Var("y", relax.TensorType([4], "int16"))
        relax.BlockBuilder().normalize(qnn.lut(y, relax.const(np.zeros(256, np.int8))))


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_lut_op_indexes_from_qmin(dtype):
    rng = np.random.default_rng(0)
    table = rng.integers(-128, 128, 256).astype(np.int8)
    q = rng.integers(*((-128, 128) if dtype == "int8" else (0, 256)), size=(3, 7)).astype(dtype)
    x = relax.Var("x", relax.TensorType(list(q.shape), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(qnn.lut(x, relax.const(table)))
        bb.emit_func_output(gv)
    got = relax.VirtualMachine(tvm.compile(bb.get(), TARGET), tvm.cpu())["main"](
        tvm.runtime.tensor(q)
    )
    offset = 128 if dtype == "int8" else 0
    np.testing.assert_array_equal(got.numpy(), table[q.astype(np.int64) + offset])


BUILD = {
    "sigmoid": relax.op.sigmoid,
    "tanh": relax.op.tanh,
    "hardswish": hardswish,
    "hardsigmoid": hardsigmoid,
    "silu": relax.op.nn.silu,
    "gelu": relax.op.nn.gelu,
    "gelu_tanh": relax.op.nn.gelu_tanh,
}


def _conv_act_conv(name):
    """conv -> activation -> conv: the activation between two integer layers."""
    b = Builder(2)
    x = b.input("x", (1, 3, 6, 6))

    def body(b):
        w1 = b.randw("c1.weight", (4, 3, 3, 3))
        y = b.emit(relax.op.nn.conv2d(x, w1, padding=1))
        y = b.emit(BUILD[name](y))
        return b.emit(relax.op.nn.conv2d(y, b.randw("c2.weight", (2, 4, 1, 1))))

    mod, params = b.build(body)
    rng = np.random.default_rng(5)
    return mod, params, [rng.normal(size=(1, 3, 6, 6)).astype(np.float32) for _ in range(6)]


@pytest.mark.parametrize("name", NAMES)
def test_each_activation_is_an_integer_lookup_predicted_bit_for_bit(name):
    mod, params, data = _conv_act_conv(name)
    cfg = Config(recipe="cnn")
    sim = simulate(mod, params, cfg)
    assert [m.pattern.name for m in sim.matches] == ["conv2d", name, "conv2d"]
    qp = autoq.calibrate(sim, params, data, cfg, target=TARGET)
    real = realize(mod, params, qp, cfg)
    ops = [
        b.value.op.name
        for blk in real["main"].body.blocks
        for b in blk.bindings
        if isinstance(b.value, relax.Call)
    ]
    # between the input quantize and the output dequantize: integer ops only
    assert ops == [
        "qnn.quantize", "qnn.conv2d", "qnn.requantize", "qnn.lut", "qnn.conv2d", "qnn.dequantize"
    ]  # fmt: skip
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    assert rep.exact and set(rep.elements) == set(sim.activation_slots()), rep.table()
    ref = np.stack([Runner(mod, params)(x) for x in data])
    got = np.stack([Runner(real)(x) for x in data])
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_a_hand_written_sigmoid_layer_realizes_to_its_table():
    """With hand-chosen qparams the realized layer is quantize -> qnn.lut(table) ->
    dequantize, the table being lut_table's for those qparams."""
    b = Builder(0)
    x = b.input("x", (1, 4))
    mod, params = b.build(lambda b: b.emit(relax.op.sigmoid(x)))
    cfg = Config(recipe="cnn")
    sim = simulate(mod, params, cfg)
    qp = QParams(
        params={
            "x": QParam(np.float32(0.05), np.int32(3), "int8"),
            "sigmoid_0": QParam(np.float32(1 / 256), np.int32(-128), "int8"),
        },
        slots=dict(sim.slots),
    )
    real = realize(mod, params, qp, cfg)
    t = lut_table("sigmoid", 0.05, 3, "int8", 1 / 256, -128, "int8")
    bb = relax.BlockBuilder()
    xv = relax.Var("x", relax.TensorType([1, 4], F32))
    c = relax.const
    with bb.function("main", [xv]):
        with bb.dataflow():
            q = bb.emit(qnn.quantize(xv, c(np.float32(0.05)), c(np.int32(3)), out_dtype="int8"))
            y = bb.emit(qnn.lut(q, c(t)))
            gv = bb.emit_output(qnn.dequantize(y, c(np.float32(1 / 256)), c(np.int32(-128))))
        bb.emit_func_output(gv)
    tvm.ir.assert_structural_equal(
        real["main"].without_attr("global_symbol"),
        bb.get()["main"].without_attr("global_symbol"),
        map_free_vars=True,
    )


def test_the_analysis_switches_a_lookup_layer_on_and_off():
    """The switched analysis graph: every switch on = the realized graph exactly; the
    activation's switch off = the float activation (the fp32 model where nothing else is
    quantized)."""
    from autoq import Analysis

    mod, params, data = _conv_act_conv("silu")
    cfg = Config(recipe="cnn")
    qp = autoq.calibrate(simulate(mod, params, cfg), params, data, cfg, target=TARGET)
    an = Analysis(mod, params, data, qp, cfg, target=TARGET)
    real = Runner(realize(mod, params, qp, cfg))
    for got, x in zip(an.run(), data, strict=True):
        np.testing.assert_array_equal(got, real(x))
    fp = Runner(mod, params)
    for got, x in zip(an.run(an.layers), data, strict=True):
        np.testing.assert_allclose(got, fp(x), rtol=1e-4, atol=1e-5)
