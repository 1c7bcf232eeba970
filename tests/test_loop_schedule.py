"""autoq.ir.loop_schedule: the cheap default schedule of calibration's kernels changes the
speed, never the bits (float data, every reduction kind the models use), and calibration
with it chooses exactly the qparams it chose without it."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq import Config, calibrate, simulate
from autoq.ir.loop_schedule import lanes_for, pipeline_with_loop_schedule, schedule_reductions
from models import small_cnn

OPT_TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})


def _module(shape, body):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _conv(bb, x, k=3, cout=16, groups=1, stride=1):
    cin = x.ty.shape.values[1]
    w = np.random.default_rng(3).normal(size=(cout, int(cin) // groups, k, k)).astype("float32")
    return bb.emit(
        relax.op.nn.conv2d(x, relax.const(w), strides=stride, padding=k // 2, groups=groups)
    )


def _conv_transpose(bb, x, k=2, cout=12, stride=2, padding=0, output_padding=0):
    cin = int(x.ty.shape.values[1])
    w = np.random.default_rng(6).normal(size=(cin, cout, k, k)).astype("float32")
    op = relax.op.nn.conv2d_transpose(
        x, relax.const(w), strides=stride, padding=padding, output_padding=output_padding
    )
    return bb.emit(op)


CASES = {
    "conv3x3": ((1, 8, 12, 12), lambda bb, x: _conv(bb, x)),
    "conv7x7_stride2_odd": ((1, 3, 15, 15), lambda bb, x: _conv(bb, x, k=7, stride=2)),
    "depthwise": ((1, 8, 10, 10), lambda bb, x: _conv(bb, x, cout=8, groups=8)),
    # rows that 16 and 8 do not divide: vectors of 15 (30 wide) and of 14 (28 wide)
    "conv1x1_row30": ((1, 16, 3, 30), lambda bb, x: _conv(bb, x, k=1)),
    "conv3x3_row28": ((1, 4, 5, 28), lambda bb, x: _conv(bb, x)),
    # more output rows than channels: the rows of output channels still accumulate together
    "conv3x3_tall": ((1, 4, 32, 16), lambda bb, x: _conv(bb, x)),
    # dilation and padding copies vectorized and parallel, the dilation inlined
    "conv_transpose2x2_stride2": ((1, 8, 10, 10), lambda bb, x: _conv_transpose(bb, x)),
    "conv_transpose3x3_stride2_pad": (
        (1, 4, 7, 9),
        lambda bb, x: _conv_transpose(bb, x, k=3, padding=1, output_padding=1),
    ),
    "dense": (
        (3, 40),
        lambda bb, x: bb.emit(
            relax.op.matmul(
                x, relax.const(np.random.default_rng(4).normal(size=(40, 24)).astype("float32"))
            )
        ),
    ),
    "batch_matmul": (
        (16, 16, 40),
        lambda bb, x: bb.emit(
            relax.op.matmul(
                x,
                relax.const(np.random.default_rng(5).normal(size=(16, 40, 24)).astype("float32")),
            )
        ),
    ),
    "maxpool": ((1, 4, 9, 9), lambda bb, x: bb.emit(relax.op.nn.max_pool2d(x, 3, 2))),
    "mean": ((1, 6, 7, 7), lambda bb, x: bb.emit(relax.op.mean(x, axis=[2, 3], keepdims=True))),
    "softmax": ((2, 33), lambda bb, x: bb.emit(relax.op.nn.softmax(x))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedule_keeps_the_bits(case):
    target = OPT_TARGET  # vectorized AVX-512 code with FMA contraction available
    shape, body = CASES[case]
    mod = _module(shape, body)
    x = np.random.default_rng(0).normal(size=shape).astype("float32") * 3
    x.flat[:4] = [-0.0, np.inf, -np.inf, np.nan]  # signed zeros, infinities, NaNs
    outs = []
    for pipeline in (None, pipeline_with_loop_schedule(target)):
        ex = (
            tvm.compile(mod, target, relax_pipeline=pipeline)
            if pipeline
            else tvm.compile(mod, target)
        )
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    assert outs[0].dtype == outs[1].dtype
    # every bit but a NaN's sign: LLVM may commute an fadd and x86 then keeps the other
    # operand's NaN (a mean over -inf, inf and NaN differs so before the copies too)
    nan = np.isnan(outs[0])
    assert np.array_equal(nan, np.isnan(outs[1]))
    assert np.array_equal(outs[0][~nan].view("uint32"), outs[1][~nan].view("uint32"))


def test_reduction_kernels_get_parallel_vector_loops():
    shape, body = CASES["conv3x3"]
    legal = relax.transform.LegalizeOps()(_module(shape, body))
    conv = next(f for gv, f in legal.functions_items() if gv.name_hint.startswith("conv2d"))
    text = schedule_reductions(conv).script()
    assert "T.parallel" in text and "T.vectorized" in text
    assert "T.parallel" not in conv.script()
    # elementwise kernels (no reduction) are left alone
    relu = relax.transform.LegalizeOps()(
        _module((1, 4), lambda bb, x: bb.emit(relax.op.nn.relu(x)))
    )
    f = next(f for _, f in relu.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert schedule_reductions(f).same_as(f)


def test_lanes_are_a_whole_register_else_the_largest_divisor():
    assert [lanes_for(n) for n in (224, 120, 56)] == [16, 8, 8]
    assert [lanes_for(n) for n in (60, 30, 28, 15, 12)] == [15, 15, 14, 15, 12]
    # no divisor from 16 to 4: the whole row up to 32, else unscheduled
    assert [lanes_for(n) for n in (7, 3, 31, 34)] == [7, 3, 31, None]
    assert (
        "T.vectorized(T.int64(15))" in schedule_reductions(_conv_kernel("conv1x1_row30")).script()
    )


def _conv_kernel(case):
    legal = relax.transform.LegalizeOps()(_module(*CASES[case]))
    return next(f for gv, f in legal.functions_items() if gv.name_hint.startswith("conv2d"))


def test_transposed_conv_copies_are_vectorized_and_the_dilation_inlined():
    legal = relax.transform.LegalizeOps()(_module(*CASES["conv_transpose2x2_stride2"]))
    conv = next(f for gv, f in legal.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert 'T.sblock("data_dilate")' in conv.script()
    text = schedule_reductions(conv).script()
    assert 'T.sblock("data_dilate")' not in text
    lines = text.splitlines()
    pad = next(i for i, ln in enumerate(lines) if 'T.sblock("data_pad")' in ln)
    assert "T.vectorized" in lines[pad - 1] and "T.parallel" in lines[pad - 3]


def test_rows_are_output_channels_that_share_the_input_row():
    # 16 channels of 32 rows: the unrolled loop (8 rows) is the channel loop ``ff``, not the
    # larger ``yy`` whose rows read different input rows
    text = schedule_reductions(_conv_kernel("conv3x3_tall"), rows=8).script()
    unrolled = [ln for ln in text.splitlines() if "T.unroll(T.int64(8))" in ln]
    assert unrolled and all(ln.split()[1].startswith("ff") for ln in unrolled), unrolled


@pytest.mark.parametrize("mode", ["topological", "fp32"])
def test_calibration_qparams_unchanged(monkeypatch, mode):
    mod, params, data = small_cnn()
    config = Config(recipe="cnn", calibration=mode)
    sim = simulate(mod, params, config)
    fast = calibrate(sim, params, data(6, 2), config, target=OPT_TARGET)
    monkeypatch.setattr(
        importlib.import_module("autoq.calibration"), "calibration_pipeline", lambda t: None
    )
    plain = calibrate(sim, params, data(6, 2), config, target=OPT_TARGET)
    assert set(fast) == set(plain)
    for sid in plain:
        a, b = fast[sid], plain[sid]
        assert np.array_equal(a.scale, b.scale) and np.array_equal(a.zero_point, b.zero_point), sid
