"""Layers that used to stay fake-quantized and now run on integers (issue 14): windowed
average pools (patterns/avg_pool2d.py) and elementwise ops with a constant operand
(patterns/elementwise.py; ``x / c`` through canonicalization as ``x * (1/c)``).

Each is checked three ways: the realized graph has the integer form and no float op; the
simulated graph predicts every realized integer bit for bit (autoq.fallback.fidelity.compare); and
the result is close to the float model (numpy / the fp32 module as reference).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_realize import cfg, exact, quantize_all
from tvm import relax

from models import Builder, conv, op_sequence, run

SHAPE = (1, 4, 8, 8)


def _model(op_fn, const=None):
    """x -> conv c1 -> op (reading the constant ``const`` when given) -> add(op, op)."""
    b = Builder(3)
    x = b.input("x", SHAPE)

    def body(b):
        y = conv(b, x, "c1", SHAPE[1], 4)
        z = b.emit(op_fn(y) if const is None else op_fn(y, relax.const(const)))
        return b.emit(relax.op.add(z, z))

    return b.build(body)


def _data(n=3):
    return [np.random.default_rng(i).normal(size=SHAPE).astype(np.float32) for i in range(n)]


def _check(mod, params, expected_ops, rel_tol):
    data = _data()
    sim, qp, real = quantize_all(mod, params, data, cfg())
    seq = op_sequence(real)
    for item in expected_ops:
        assert item in seq, seq
    # no float op between the input quantize and the output dequantize
    inner = seq[1:-1]
    assert all(dtype != "float32" for _, dtype in inner), seq
    exact(sim, qp, real, data)
    x = data[0]
    ref = run(mod, [x], params)
    got = run(real, [x])
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < rel_tol, err
    return qp, real


@pytest.mark.parametrize(
    "attrs",
    [
        {"pool_size": 2, "strides": 2},
        {"pool_size": 3, "strides": 1, "padding": 1, "count_include_pad": True},
        {"pool_size": 2, "strides": 2, "ceil_mode": True},  # no partial window on 8x8
    ],
)
def test_average_pool_is_an_integer_window_sum(attrs):
    mod, params = _model(lambda y: relax.op.nn.avg_pool2d(y, **attrs))
    _check(mod, params, [("qnn.conv2d", "int32"), ("qnn.requantize", "int8")], 0.05)


@pytest.mark.parametrize(
    "pool",
    [
        {"pool_size": 3, "strides": 1, "padding": 1, "count_include_pad": False},
        {"pool_size": 3, "strides": 2, "padding": 1, "count_include_pad": True, "ceil_mode": True},
    ],
)
def test_average_pool_with_a_varying_count_stays_float(pool):
    """count_include_pad=False with padding, or a partial ceil_mode window: the border
    windows average fewer values than the others."""
    mod, params = _model(lambda y: relax.op.nn.avg_pool2d(y, **pool))
    _, _, real = quantize_all(mod, params, _data(), cfg())
    assert ("nn.avg_pool2d", "float32") in op_sequence(real)


CONSTANTS = {
    "multiply": (relax.op.multiply, np.float32(0.37), "qnn.multiply"),
    "multiply per channel": (
        relax.op.multiply,
        np.array([0.5, 1.0, 1.5, 2.0], np.float32).reshape(1, 4, 1, 1),
        "qnn.multiply",
    ),
    "add": (relax.op.add, np.float32(0.8), "qnn.add"),
    "subtract": (relax.op.subtract, np.float32(-0.25), "qnn.subtract"),
}


def test_division_by_a_constant_is_a_multiplication_by_its_reciprocal():
    """``x / c`` is canonicalized to ``x * float32(1/c)`` and quantized like ``x * c``."""
    c = np.array([0.5, 3.0, -7.0, 2.0], np.float32).reshape(1, 4, 1, 1)
    mod, params = _model(relax.op.divide, c)
    qp, _ = _check(mod, params, [("qnn.multiply", "int8")], 0.05)
    (layer,) = [k for k in qp if k.endswith(".weight") and k != "c1.weight"]
    w = qp[layer]
    np.testing.assert_allclose(
        (np.round((1 / c) / w.scale) - w.zero_point) * w.scale, 1 / c, atol=float(w.scale) / 2
    )


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_elementwise_with_a_constant_operand(name):
    op, c, qnn_op = CONSTANTS[name]
    mod, params = _model(op, c)
    qp, _ = _check(mod, params, [(qnn_op, "int8")], 0.05)
    # the constant is an int8 constant with its own per-tensor qparams
    (layer,) = [k[: -len(".weight")] for k in qp if k.endswith(".weight") and k != "c1.weight"]
    w = qp[f"{layer}.weight"]
    assert w.axis is None and np.ndim(w.scale) == 0
    np.testing.assert_allclose(
        (np.round(c / w.scale) - w.zero_point) * w.scale, c, atol=float(w.scale) / 2 + 1e-7
    )


def test_requantize_uses_the_multiplier_and_shift_it_carries():
    """A 7-argument qnn.requantize computes with its own int32 multiplier and shift (the
    scales then only describe the tensors); numpy reference: round_half_even(x * m *
    2**(shift - 31)) + zp, clipped."""
    from autoq import primitives as P
    from autoq import qnn
    from models import run as run_mod

    x = np.arange(-300, 300, 7, dtype=np.int32).reshape(1, -1)
    bb = relax.BlockBuilder()
    v = relax.Var("x", relax.TensorType(list(x.shape), "int32"))
    s_in, s_out = np.float32(0.01), np.float32(0.05)
    m, sh = P.quantize_multiplier(np.float64(0.3))  # not s_in / s_out = 0.2
    with bb.function("main", [v]):
        with bb.dataflow():
            y = bb.emit(
                qnn.requantize(
                    v, relax.const(s_in), relax.const(np.int32(0)), relax.const(s_out),
                    relax.const(np.int32(3)), rounding="half_even",
                    multiplier=relax.const(np.int32(m)), shift=relax.const(np.int32(sh)),
                )
            )  # fmt: skip
            gv = bb.emit_output(y)
        bb.emit_func_output(gv)
    got = run_mod(bb.get(), [x])
    ref = np.clip(np.round(x * (int(m) * 2.0 ** (int(sh) - 31))) + 3, -128, 127)
    np.testing.assert_array_equal(got, ref.astype(np.int8))
    with pytest.raises(Exception, match="rounding='float'"):
        relax.BlockBuilder().normalize(
            qnn.requantize(
                v, relax.const(s_in), relax.const(np.int32(0)), relax.const(s_out),
                relax.const(np.int32(3)), multiplier=relax.const(np.int32(m)),
                shift=relax.const(np.int32(sh)),
            )
        )  # fmt: skip
