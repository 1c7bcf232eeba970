"""autoq.cpu.reciprocal_elementwise: qnn.add / subtract of two 8-bit tensors and the 8-bit
requantize after them divide by a reciprocal on the AMX targets, bit for bit the generic
legalization and the numpy reference on every code pair."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_cpu_amx import AMX_TARGET, needs_amx
from tvm import relax, te

import autoq
from autoq import qnn
from autoq.cpu.injective import schedule_fused
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.primitives import elementwise, qrange, requantize

# every pair of codes: a plane of 256 x 256 = 65536 elements
SHAPE = (1, 4, 128, 128)


def _all_pairs(dtype: str):
    lo, hi = qrange(dtype)
    codes = np.arange(lo, hi + 1)
    a, b = np.meshgrid(codes, codes, indexing="ij")
    return a.reshape(SHAPE).astype(dtype), b.reshape(SHAPE).astype(dtype)


def _module(op: str, dtype: str, s_out: float):
    """main(a, b) = requantize(qnn.<op>(a, b) -> dtype, 0.04, -5)."""
    a = relax.Var("a", relax.TensorType(SHAPE, dtype))
    b = relax.Var("b", relax.TensorType(SHAPE, dtype))
    c = relax.const
    zs = (3, -7, 2) if dtype == "int8" else (131, 120, 126)
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            q = [c(np.float32(0.0209)), c(np.int32(zs[0])), c(np.float32(0.0113))]
            q += [c(np.int32(zs[1])), c(np.float32(s_out)), c(np.int32(zs[2]))]
            y = bb.emit(getattr(qnn, op)(a, b, *q, out_dtype=dtype, rounding="float"))
            q = [c(np.float32(s_out)), c(np.int32(zs[2])), c(np.float32(0.04)), c(np.int32(-5))]
            out = bb.emit_output(bb.emit(qnn.requantize(y, *q, out_dtype="int8")))
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]}), zs


def _run(mod, a, b, **options):
    vm = relax.VirtualMachine(autoq.compile(mod, AMX_TARGET, **options), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()


@needs_amx
@pytest.mark.parametrize(
    ("op", "dtype", "s_out"),
    [
        ("add", "int8", 0.0214),  # ResNet-50 open_nsfw's projection add
        ("subtract", "uint8", 0.0377),
        ("add", "int8", 1.99999988 * 2.0**-6),  # the worst reciprocal (mantissa all ones)
    ],
)
def test_every_code_pair_bit_exact(op, dtype, s_out):
    mod, (za, zb, zo) = _module(op, dtype, s_out)
    lowered = lower_to_cpu_kernels(mod, AMX_TARGET)
    funcs = [f.script() for gv, f in lowered.functions.items() if "qnn" in gv.name_hint]
    assert len(funcs) == 2 and all(" / " not in f and "fma" in f for f in funcs)
    a, b = _all_pairs(dtype)
    got = _run(mod, a, b)
    y = elementwise(op, a, 0.0209, za, b, 0.0113, zb, s_out, zo, dtype, "float")
    np.testing.assert_array_equal(got, requantize(y, s_out, zo, 0.04, -5, "int8"))
    np.testing.assert_array_equal(got, _run(mod, a, b, cpu_kernels=False))


def test_other_ops_keep_their_legalization():
    """A per-channel requantize and an int32 one are not 8-bit per-tensor: no TE call of
    this module (their legalization divides)."""
    x = relax.Var("x", relax.TensorType(SHAPE, "int8"))
    c = relax.const
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            s = c(np.full(SHAPE[1], 0.03, np.float32) * np.arange(1, 5, dtype=np.float32))
            q = [c(np.float32(0.02)), c(np.int32(1)), s, c(np.zeros(SHAPE[1], np.int32))]
            y = bb.emit(qnn.requantize(x, *q, axis=1, out_dtype="int8"))
            q = [c(np.float32(0.02)), c(np.int32(1)), c(np.float32(1e-4)), c(np.int32(0))]
            z = bb.emit(qnn.requantize(y, *q, out_dtype="int32"))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    lowered = lower_to_cpu_kernels(tvm.IRModule({"main": bb.get()["main"]}), AMX_TARGET)
    scripts = [f.script() for gv, f in lowered.functions.items() if "requantize" in gv.name_hint]
    assert len(scripts) == 2 and all(" / " in f for f in scripts)


def test_elementwise_blocks_run_in_explicit_vectors():
    """A block reading only its own element runs its 56 x 56 planes (no width of
    ELEMENTWISE_LANES divides a 56-wide row) in 64-lane vectors, parallel over the planes;
    same results."""
    a = te.placeholder((2, 56, 56), "float32", name="a")
    out = te.compute(a.shape, lambda *i: a[i] + np.float32(1), name="out")
    func = schedule_fused(te.create_prim_func([a, out]))
    text = func.script()
    assert "T.vectorized(64)" in text and "T.parallel(98)" in text  # 2 x 3136 / 64
    x = np.random.default_rng(0).standard_normal((2, 56, 56)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros_like(x))
    tvm.compile(tvm.IRModule({"main": func}), "llvm")["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), x + np.float32(1))
