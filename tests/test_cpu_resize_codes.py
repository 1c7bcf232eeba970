"""autoq.cpu.resize_codes: ``qnn.quantize(resize2d(qnn.dequantize(q)))`` with a nearest
resize runs as a lookup of the low-resolution codes and an int8 resize: bit for bit the
legalization of the float chain and numpy's reference, through the add that reads it;
bilinear resizes and per-channel dequantizes keep the float chain."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import primitives as P
from autoq import qnn
from autoq.cpu.resize_codes import code_table, resize_codes
from autoq.ir.toolkit import bindings, dtype_of, is_call

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
F32 = "float32"
S1, Z1, S2, Z2, SB, ZB, SO, ZO = 0.47, -19, 0.31, 3, 0.29, 7, 0.56, -4


def _module(dtype, method="nearest_neighbor", scale=None, factor=2, add=True):
    """main(q[1, 4, 8, 8], b[1, 4, 8f, 8f]) = qnn.add(b, quantize(resize(dequantize(q))))
    (``add=False``: the quantized resize itself, b unused)."""
    side = 8 * factor
    q = relax.Var("q", relax.TensorType((1, 4, 8, 8), dtype))
    b = relax.Var("b", relax.TensorType((1, 4, side, side), "int8"))
    c = relax.const
    z1 = Z1 + 128 if dtype == "uint8" else Z1
    bb = relax.BlockBuilder()
    with bb.function("main", [q, b]):
        s1 = c(S1, F32) if scale is None else c(np.array(scale, np.float32))
        axis = -1 if scale is None else 1
        d = bb.emit(qnn.dequantize(q, s1, c(z1, "int32"), axis=axis))
        r = bb.emit(relax.op.image.resize2d(d, (side, side), method=method))
        rq = bb.emit(qnn.quantize(r, c(S2, F32), c(Z2, "int32"), out_dtype="int8"))
        out = rq if not add else bb.emit(qnn.add(b, rq, c(SB, F32), c(ZB, "int32"), c(S2, F32), c(Z2, "int32"),
                              c(SO, F32), c(ZO, "int32"), out_dtype="int8", rounding="float"))  # fmt: skip
        bb.emit_func_output(out)
    return bb.get()


def _int8_resizes(mod) -> int:
    main = resize_codes(mod)["main"]
    return sum(
        is_call(e, "relax.image.resize2d") and dtype_of(e) in ("int8", "uint8")
        for _, e in bindings(main)
    )


def _run(mod, cpu_kernels: bool, *arrays):
    vm = relax.VirtualMachine(autoq.compile(mod, TARGET, cpu_kernels=cpu_kernels), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


@pytest.mark.parametrize("dtype, factor", [("int8", 2), ("uint8", 4)])
def test_nearest_resize_runs_on_the_codes_bit_exact(dtype, factor):
    """The quantized resize and the add that reads it against numpy's reference and the
    float chain's legalization."""
    mod, alone = _module(dtype, factor=factor), _module(dtype, factor=factor, add=False)
    assert _int8_resizes(mod) == 1 and _int8_resizes(alone) == 1
    rng = np.random.default_rng(1)
    lo = -128 if dtype == "int8" else 0
    q = rng.permutation(np.arange(lo, lo + 256)).astype(dtype).reshape(1, 4, 8, 8)  # every code
    side = 8 * factor
    b = rng.integers(-128, 128, (1, 4, side, side)).astype(np.int8)
    got = _run(mod, True, q, b)
    np.testing.assert_array_equal(got, _run(mod, False, q, b))
    up = q.repeat(factor, 2).repeat(factor, 3)
    z1 = Z1 + 128 if dtype == "uint8" else Z1
    want = P.quantize(P.dequantize(up, S1, z1), S2, Z2, "int8")
    np.testing.assert_array_equal(_run(alone, True, q, b), want)
    assert len(np.unique(want)) > 100
    added = P.elementwise("add", b, SB, ZB, want, S2, Z2, SO, ZO, "int8", rounding="float")
    np.testing.assert_array_equal(got, added)
    assert len(np.unique(got)) > 40, "the case must span many output codes"


def test_code_table_is_the_float_chain_on_every_code():
    codes = np.arange(-128, 128).astype(np.int8)
    want = P.quantize(P.dequantize(codes, S1, Z1), S2, Z2, "int8")
    np.testing.assert_array_equal(code_table(S1, Z1, S2, Z2, "int8", "int8"), want)


def test_bilinear_and_per_channel_keep_the_float_chain():
    assert _int8_resizes(_module("int8", method="linear")) == 0
    assert _int8_resizes(_module("int8", scale=[0.4, 0.5, 0.3, 0.2])) == 0
