"""autoq.cpu's lowering of a per-tensor ``qnn.add / subtract / multiply`` with one constant
operand (attention's scores times ``1 / sqrt(d)``) to the VBMI lookup kernel: on every input
code, in every rounding mode it takes, bit for bit the op's own legalization and numpy's
reference; TFLite rounding and run-time operands keep the legalization."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import primitives as P
from autoq import qnn
from autoq.cpu.lowering import lower_to_cpu_kernels

FLAGS = open("/proc/cpuinfo").read()
pytestmark = pytest.mark.skipif("avx512vbmi" not in FLAGS, reason="this CPU has no AVX-512 VBMI")
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
F32 = "float32"
# (op, data dtype, constant side, rounding, output dtype)
CASES = {
    "multiply-int8-rhs-half_even": ("multiply", "int8", "rhs", "half_even", "int8"),
    "multiply-int8-lhs-float": ("multiply", "int8", "lhs", "float", "int8"),
    "add-uint8-rhs-half_away": ("add", "uint8", "rhs", "half_away", "uint8"),
    "subtract-int8-lhs-half_up": ("subtract", "int8", "lhs", "half_up", "int8"),
    "subtract-uint8-rhs-tflite_single": ("subtract", "uint8", "rhs", "tflite_single", "int8"),
    "add-int8-rhs-float": ("add", "int8", "rhs", "float", "uint8"),
}


def _module(op, dtype, side, rounding, out_dtype, const=None):
    """main(x[2, 128]) = qnn.<op>(x, c) (or (c, x)), scales that make many output codes."""
    x = relax.Var("x", relax.TensorType((2, 128), dtype))
    c = relax.const(np.array(-77 if dtype == "int8" else 201, dtype)) if const is None else const
    lhs, rhs = (x, c) if side == "rhs" else (c, x)
    sa, sb, so = (0.05, 0.011, 0.02) if op == "multiply" else (0.05, 0.031, 0.07)
    q = [relax.const(v, t) for v, t in ((sa, F32), (3, "int32"), (sb, F32), (5, "int32"))]
    q += [relax.const(so, F32), relax.const(7, "int32")]
    bb = relax.BlockBuilder()
    params = [x] if const is None else [x, const]
    with bb.function("main", params):
        out = bb.emit(getattr(qnn, op)(lhs, rhs, *q, out_dtype=out_dtype, rounding=rounding))
        bb.emit_func_output(out)
    return bb.get(), (sa, 3, sb, 5, so, 7)


def _run(mod, cpu_kernels: bool, *arrays):
    vm = relax.VirtualMachine(autoq.compile(mod, TARGET, cpu_kernels=cpu_kernels), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def _lut_calls(mod) -> int:
    lowered = lower_to_cpu_kernels(mod, TARGET)
    return sum(gv.name_hint.startswith("autoq_lut") for gv in lowered.functions)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_constant_operand_runs_as_lookup_bit_exact(case):
    op, dtype, side, rounding, out_dtype = case
    mod, (sa, za, sb, zb, so, zo) = _module(op, dtype, side, rounding, out_dtype)
    assert _lut_calls(mod) == 1
    lo = -128 if dtype == "int8" else 0
    x = np.arange(lo, lo + 256).astype(dtype).reshape(2, 128)  # every code
    got = _run(mod, True, x)
    np.testing.assert_array_equal(got, _run(mod, False, x))
    c = np.int64(-77 if dtype == "int8" else 201)
    lhs, rhs = (x, c) if side == "rhs" else (c, x)
    want = P.elementwise(op, lhs, sa, za, rhs, sb, zb, so, zo, out_dtype, rounding)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 40, "the case must span many output codes"


def test_tflite_rounding_runtime_and_rank_raising_operands_keep_the_legalization():
    tflite, _ = _module("multiply", "int8", "rhs", "tflite", "int8")
    runtime, _ = _module(
        "multiply", "int8", "rhs", "half_even", "int8", relax.Var("c", relax.TensorType((), "int8"))
    )
    assert _lut_calls(tflite) == 0 and _lut_calls(runtime) == 0
    wider = relax.const(np.full((1, 1, 1), 5, np.int8))  # output [1, 2, 128], not x's shape
    x = relax.Var("x", relax.TensorType((2, 128), "int8"))
    q = [relax.const(v, t) for v, t in ((0.05, F32), (3, "int32"), (0.011, F32), (5, "int32"))]
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        out = bb.emit(qnn.multiply(x, wider, *q, relax.const(0.02, F32), relax.const(7, "int32"),
                                   out_dtype="int8", rounding="half_even"))  # fmt: skip
        bb.emit_func_output(out)
    mod = bb.get()
    assert _lut_calls(mod) == 0
    codes = np.arange(-128, 128).astype(np.int8).reshape(2, 128)
    np.testing.assert_array_equal(_run(mod, True, codes), _run(mod, False, codes))


@pytest.mark.parametrize(
    ("op", "shape", "luts"), [("add", (1, 6, 16, 16), 1), ("multiply", (18, 6, 3, 5), 0)]
)
def test_per_channel_constant_runs_as_channel_lookup_bit_exact(op, shape, luts):
    """A constant of one value per channel of NCHW data (``[1, C, 1, 1]``: ResNet-50
    open_nsfw's batch-norm shifts) runs as one table per channel on planes of >= 64 elements
    (256: the VBMI kernel) and keeps the float chain on smaller ones (15), every code in
    every channel, against the legalization and numpy."""
    n, channels, h, w = shape
    consts = np.random.default_rng(3).integers(-128, 128, (1, channels, 1, 1)).astype(np.int8)
    sa, za, sb, zb, so, zo = (0.05, 3, 0.011, 5, 0.02, 7) if op == "multiply" else (
        0.05, 3, 0.031, 5, 0.07, 7)  # fmt: skip
    x = relax.Var("x", relax.TensorType(shape, "int8"))
    q = [relax.const(v, t) for v, t in ((sa, F32), (za, "int32"), (sb, F32), (zb, "int32"))]
    q += [relax.const(so, F32), relax.const(zo, "int32")]
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        call = getattr(qnn, op)(x, relax.const(consts), *q, out_dtype="int8", rounding="half_even")
        bb.emit_func_output(bb.emit(call))
    mod = bb.get()
    assert _lut_calls(mod) == luts
    # each channel's n * h * w >= 256 elements: every code, rotated per channel
    per = np.resize(np.arange(-128, 128), n * h * w)
    xs = np.stack([np.roll(per, 37 * c) for c in range(channels)])
    xs = xs.reshape(channels, n, h, w).transpose(1, 0, 2, 3).astype(np.int8)
    got = _run(mod, True, xs)
    np.testing.assert_array_equal(got, _run(mod, False, xs))
    want = P.elementwise(
        op, xs, sa, za, consts.astype(np.int64), sb, zb, so, zo, "int8", "half_even"
    )
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(got)) > 40, "the case must span many output codes"
