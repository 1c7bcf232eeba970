"""The canonical layer shapes as a specification: realize() with hand-written qparams against
Before / Expected modules (tvm.ir.assert_structural_equal).

The qparams are chosen by hand (no calibration), so every constant of the expected module
is computed here with numpy from those numbers: int8 weights = round(w / s_w), the int32
bias = round(b / (s_x * s_w)), the accumulator scale s_x * s_w, a mean's scale s / N.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from autoq import Config, QParam, QParams, qnn, realize, simulate
from models import Builder

F32 = "float32"


def c(v, dtype):
    return relax.const(np.asarray(v, dtype), dtype)


def hand_qparams(mod, params, config, chosen: dict) -> QParams:
    """QParams for every slot of ``mod`` from ``chosen`` (slot -> QParam)."""
    sim = simulate(mod, params, config)
    assert set(sim.slots) == set(chosen), (sorted(sim.slots), sorted(chosen))
    return QParams(params=dict(chosen), slots=dict(sim.slots))


def expected_module(inputs: dict[str, tuple], body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    xs = [relax.Var(n, relax.TensorType(list(s), F32)) for n, s in inputs.items()]
    with bb.function("main", xs):
        with bb.dataflow():
            gv = bb.emit_output(body(bb, *xs))
        bb.emit_func_output(gv)
    return bb.get()


def same(real: tvm.IRModule, expected: tvm.IRModule) -> None:
    tvm.ir.assert_structural_equal(
        real["main"].without_attr("global_symbol"),
        expected["main"].without_attr("global_symbol"),
        map_free_vars=True,
    )


def pt(scale, zp, dtype="int8"):
    return QParam(np.float32(scale), np.int32(zp), dtype)


def test_dense_bias_residual_add():
    """y = x @ W^T + b + r: one int32 accumulator, the residual requantized onto its grid."""
    b = Builder(0)
    x, r = b.input("x", (1, 4)), b.input("r", (1, 3))
    w = np.array([[0.5, -0.25, 0.125, 1.0], [0.0, 0.75, -0.5, 0.25], [1.0, 0.5, 0.25, -1.0]])
    bias = np.array([0.1, -0.2, 0.3])

    def body(b):
        fc = b.emit(relax.op.matmul(x, relax.op.permute_dims(b.weight("fc.weight", w), [1, 0])))
        return b.emit(relax.op.add(b.emit(relax.op.add(fc, b.weight("fc.bias", bias))), r))

    mod, params = b.build(body)
    s_w = np.array([1 / 127, 0.75 / 127, 1 / 127], np.float32)  # max |w| per row / 127
    chosen = {
        "x": pt(0.05, 3),
        "r": pt(0.1, -2),
        "fc.weight": QParam(s_w, np.zeros(3, np.int32), "int8", axis=1),
    }
    cfg = Config(recipe="cnn")
    real = realize(mod, params, hand_qparams(mod, params, cfg, chosen), cfg)
    s_acc = (np.float32(0.05) * s_w).astype(np.float32)
    w_int8 = np.clip(np.rint(w.astype(np.float32) / s_w[:, None]), -127, 127).astype(np.int8)
    b_int32 = np.rint(bias.astype(np.float32) / s_acc).astype(np.int32).reshape(1, 3)

    def body_expected(bb, x, r):
        qx = bb.emit(qnn.quantize(x, c(0.05, F32), c(3, "int32"), out_dtype="int8"))
        acc = bb.emit(
            qnn.dense(qx, c(w_int8, "int8"), c(0.05, F32), c(3, "int32"), c(s_w, F32),
                      c(np.zeros(3), "int32"))
        )  # fmt: skip
        acc = bb.emit(relax.op.add(acc, c(b_int32, "int32")))
        qr = bb.emit(qnn.quantize(r, c(0.1, F32), c(-2, "int32"), out_dtype="int8"))
        rr = bb.emit(
            qnn.requantize(qr, c(0.1, F32), c(-2, "int32"), c(s_acc, F32), c(np.zeros(3), "int32"),
                           axis=1, out_dtype="int32")
        )  # fmt: skip
        acc = bb.emit(relax.op.add(acc, rr))
        return qnn.dequantize(acc, c(s_acc, F32), c(np.zeros(3), "int32"), axis=1)

    same(real, expected_module({"x": (1, 4), "r": (1, 3)}, body_expected))


def test_elementwise_add_has_its_own_output_qparams():
    b = Builder(0)
    x, y = b.input("x", (1, 4)), b.input("y", (1, 4))
    mod, params = b.build(lambda b: b.emit(relax.op.add(x, y)))
    chosen = {"x": pt(0.1, 0), "y": pt(0.2, 5), "add_0": pt(0.25, -1)}
    cfg = Config(recipe="cnn")
    real = realize(mod, params, hand_qparams(mod, params, cfg, chosen), cfg)

    def body_expected(bb, x, y):
        qx = bb.emit(qnn.quantize(x, c(0.1, F32), c(0, "int32"), out_dtype="int8"))
        qy = bb.emit(qnn.quantize(y, c(0.2, F32), c(5, "int32"), out_dtype="int8"))
        q = bb.emit(
            qnn.add(qx, qy, c(0.1, F32), c(0, "int32"), c(0.2, F32), c(5, "int32"),
                    c(0.25, F32), c(-1, "int32"), out_dtype="int8")
        )  # fmt: skip
        return qnn.dequantize(q, c(0.25, F32), c(-1, "int32"))

    same(real, expected_module({"x": (1, 4), "y": (1, 4)}, body_expected))


def test_global_average_pool_is_an_integer_sum_with_the_scale_divided_by_n():
    """mean over H, W of a 1x2x3x3 tensor: qnn.sum, then dequantize with scale 0.2 / 9."""
    b = Builder(0)
    x = b.input("x", (1, 2, 3, 3))
    mod, params = b.build(lambda b: b.emit(relax.op.mean(x, axis=[2, 3], keepdims=True)))
    chosen = {"x": pt(0.2, 4)}
    cfg = Config(recipe="cnn")
    real = realize(mod, params, hand_qparams(mod, params, cfg, chosen), cfg)

    def body_expected(bb, x):
        q = bb.emit(qnn.quantize(x, c(0.2, F32), c(4, "int32"), out_dtype="int8"))
        acc = bb.emit(qnn.sum(q, c(0.2, F32), c(4, "int32"), axis=[2, 3], keepdims=True))
        return qnn.dequantize(acc, c(np.float32(0.2) / np.float32(9), F32), c(0, "int32"))

    same(real, expected_module({"x": (1, 2, 3, 3)}, body_expected))


def test_a_fallback_layer_reads_the_int8_exit_of_its_int32_producer():
    """relu(fc1(x)) -> fc2 with fc2 kept in fp32: fc1's int32 accumulator is requantized to
    int8 (relu's exit slot, zero point -128: the relu disappears) before fc2 reads it
    dequantized (autoq.rules.exits); fc2's weight stays a float constant."""
    b = Builder(0)
    x = b.input("x", (1, 2))
    w1 = np.array([[1.0, -1.0], [0.5, 0.25]])
    w2 = np.array([[0.5, 0.5], [-1.0, 2.0]])

    def body(b):
        h = b.emit(relax.op.matmul(x, relax.op.permute_dims(b.weight("fc1.weight", w1), [1, 0])))
        h = b.emit(relax.op.nn.relu(h))
        return b.emit(relax.op.matmul(h, relax.op.permute_dims(b.weight("fc2.weight", w2), [1, 0])))

    from autoq import Fallback

    mod, params = b.build(body)
    cfg = Config(recipe="cnn", fallback=Fallback(ids=("fc2",)))
    s_w = np.array([1 / 127, 0.5 / 127], np.float32)
    chosen = {
        "x": pt(0.1, 0),
        "fc1.weight": QParam(s_w, np.zeros(2, np.int32), "int8", axis=1),
        "relu_0": pt(0.02, -128),
    }
    real = realize(mod, params, hand_qparams(mod, params, cfg, chosen), cfg)
    s_acc = (np.float32(0.1) * s_w).astype(np.float32)
    w1_int8 = np.clip(np.rint(w1.astype(np.float32) / s_w[:, None]), -127, 127).astype(np.int8)

    def body_expected(bb, x):
        qx = bb.emit(qnn.quantize(x, c(0.1, F32), c(0, "int32"), out_dtype="int8"))
        acc = bb.emit(
            qnn.dense(qx, c(w1_int8, "int8"), c(0.1, F32), c(0, "int32"), c(s_w, F32),
                      c(np.zeros(2), "int32"))
        )  # fmt: skip
        wt = bb.emit(relax.op.permute_dims(c(w2, F32), [1, 0]))  # (fc2 runs in fp32)
        q = bb.emit(
            qnn.requantize(acc, c(s_acc, F32), c(np.zeros(2), "int32"), c(0.02, F32),
                           c(-128, "int32"), axis=1, out_dtype="int8")
        )  # fmt: skip
        h = bb.emit(qnn.dequantize(q, c(0.02, F32), c(-128, "int32")))
        return relax.op.matmul(h, wt)

    same(real, expected_module({"x": (1, 2)}, body_expected))
