"""simulate(): the simulated graph's structure, its slots, and their ids."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq import Config, Override, QuantSpec, qnn, simulate
from models import Builder, attention, conv, small_cnn


def one_conv_bias():
    b = Builder(0)
    x = b.input("x", (1, 3, 6, 6))
    return b.build(lambda b: conv(b, x, "c", 3, 4))


def test_conv2d_bias_simulated_form_is_pinned():
    """The documented simulated form of conv2d + bias (round-to-nearest weights: the
    weights are constants of the graph), written out by hand."""
    mod, params = one_conv_bias()
    sim = simulate(mod, params, Config(recipe="cnn", weight_rounding="nearest"))

    f32 = lambda s: relax.TensorType(s, "float32")  # noqa: E731
    i32 = lambda s: relax.TensorType(s, "int32")  # noqa: E731
    x, w, b = (
        relax.Var("x", f32([1, 3, 6, 6])),
        relax.Var("c.weight", f32([4, 3, 3, 3])),
        relax.Var("c.bias", f32([4])),
    )
    xs, xz = relax.Var("x.scale", f32([])), relax.Var("x.zero_point", i32([]))
    ws, wz = relax.Var("c.weight.scale", f32([4])), relax.Var("c.weight.zero_point", i32([4]))
    one = relax.const(np.float32(1.0))
    zeros = relax.const(np.zeros(4, np.int32))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b, xs, xz, ws, wz]):
        with bb.dataflow():
            rb = bb.emit(relax.op.reshape(b, [1, 4, 1, 1]))
            xq = bb.emit(qnn.simulated_quantize(x, xs, xz, dtype="int8"))
            wq = bb.emit(qnn.simulated_quantize(w, ws, wz, axis=0, dtype="int8"))
            xc = bb.emit(qnn.simulated_dequantize(xq, one, xz))
            wc = bb.emit(qnn.simulated_dequantize(wq, one, wz, axis=0))
            acc = bb.emit(relax.op.nn.conv2d(xc, wc, padding=1))
            s_acc = bb.emit(relax.op.multiply(xs, ws))
            flat = bb.emit(relax.op.reshape(rb, [4]))
            bq = bb.emit(qnn.simulated_quantize(flat, s_acc, zeros, axis=0, dtype="int32"))
            bq4 = bb.emit(relax.op.reshape(bq, [1, 4, 1, 1]))
            acc2 = bb.emit(relax.op.add(acc, bq4))
            out = bb.emit(qnn.simulated_dequantize(acc2, s_acc, zeros, axis=1))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    expected = bb.get()["main"]
    tvm.ir.assert_structural_equal(
        sim.mod["main"].without_attr("global_symbol"),
        expected.without_attr("global_symbol"),
        map_free_vars=True,
    )


def test_slots_of_the_cnn_are_stable_and_meaningful():
    mod, params, _ = small_cnn()
    a = simulate(mod, params, Config(recipe="cnn"))
    b = simulate(mod, params, Config(recipe="cnn"))
    assert list(a.slots) == list(b.slots)
    assert a.weight_slots() == [
        f"{n}.weight" for n in ("stem", "block.conv1", "block.conv2", "dw", "fc")
    ]
    # activation slots are named by the tensor's producer: the input, relu outputs, ...
    acts = a.activation_slots()
    assert acts[0] == "x"
    assert all(s.startswith(("relu_", "max_pool2d_", "reshape_", "x")) for s in acts), acts
    info = a.slots["block.conv2.weight"]
    assert (info.kind, info.layer, info.op, info.axis, info.shape) == (
        "weight",
        "block.conv2",
        "conv2d_bias_add",
        0,
        (8, 8, 3, 3),
    )
    # the residual tensor feeds conv1 and the residual add: one slot, shared
    assert acts.count("relu_0") == 1


def test_everything_outside_matches_stays_fp32():
    mod, params, _ = attention()
    sim = simulate(mod, params, Config(recipe="cnn"))
    ops = [
        b.value.op.name
        for blk in sim.mod["main"].body.blocks
        for b in blk.bindings
        if hasattr(b.value, "op") and hasattr(b.value.op, "name")
    ]
    # softmax runs in float between the two matmuls (the constant scaling is a layer)
    assert "relax.nn.softmax" in ops
    layers = ["attn.q", "attn.k", "attn.v", "matmul_3", "multiply_0", "matmul_4", "attn.out"]
    assert sim.layers == layers
    assert [m.pattern.name for m in sim.matches] == ["dense_bias"] * 3 + [
        "matmul",
        "multiply_const",
        "matmul",
        "dense_bias_add",
    ]


def test_qparams_are_runtime_inputs_of_the_simulated_module():
    mod, params, _ = small_cnn()
    sim = simulate(mod, params, Config(recipe="cnn"))
    names = [p.name for p in sim.mod["main"].params]
    n_in = 1 + len(params)
    assert names[:n_in] == ["x", *params]
    for sid in sim.slots:
        assert f"{sid}.scale" in names and f"{sid}.zero_point" in names


def test_per_channel_off_gives_scalar_weight_slots_and_overrides_apply():
    mod, params, _ = small_cnn()
    cfg = Config(
        recipe="cnn",
        weight=QuantSpec(symmetric=True, per_channel=False),
        overrides=(Override("fc", activation=QuantSpec(dtype="uint8")),),
    )
    sim = simulate(mod, params, cfg)
    s, _ = sim.qparam_vars["stem.weight"]
    assert s.ty.ndim == 0
    fc_input = [
        sid for sid, info in sim.slots.items() if info.layer == "fc" and info.kind == "activation"
    ]
    assert fc_input and all(sim.plan.specs[sid].dtype == "uint8" for sid in fc_input)
    assert sim.plan.specs["x"].dtype == "int8"


def test_override_that_matches_nothing_is_an_error():
    mod, params, _ = small_cnn()
    cfg = Config(recipe="cnn", overrides=(Override("fc2", weight=QuantSpec(dtype="int8")),))
    with pytest.raises(
        ValueError, match=r"override 'fc2' matches no quantized layer; closest layer ids: fc"
    ):
        simulate(mod, params, cfg)
