"""autoq.cpu.gate_tables: a channel gate ``qnn.add(x, qnn.multiply(x, g))`` (g per channel,
computed at run time) runs as per-channel lookups whose tables are built at run time: on
every input code of every channel, bit for bit the chain's own legalization and numpy's
reference; small planes and a per-pixel gate keep the chain."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import primitives as P
from autoq import qnn
from autoq.cpu.gate_tables import gate_tables
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.ir.toolkit import bindings, is_call

FLAGS = open("/proc/cpuinfo").read()
pytestmark = pytest.mark.skipif("avx512vbmi" not in FLAGS, reason="this CPU has no AVX-512 VBMI")
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
F32 = "float32"
# x, gate, product, sum: (scale, zero point); x's zero point + 128 for uint8 data
QPARAMS = ((0.27, -1), (1 / 255, -128), (0.23, 8), (0.47, 10))


def _qparams(dtype):
    (sx, zx), *rest = QPARAMS
    return ((sx, zx + 128 if dtype == "uint8" else zx), *rest)


def _module(dtype, rounding, shape=(1, 3, 20, 20), gate_shape=None, swap=False):
    """main(x, g) = qnn.add(x, qnn.multiply(x, g)) (``swap``: the operands the other way)."""
    x = relax.Var("x", relax.TensorType(shape, dtype))
    g = relax.Var("g", relax.TensorType(gate_shape or (1, shape[1], 1, 1), "int8"))
    (sx, zx), (sg, zg), (sm, zm), (so, zo) = _qparams(dtype)
    c = relax.const
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        mul_args = (g, x, c(sg, F32), c(zg, "int32"), c(sx, F32), c(zx, "int32")) if swap else (
            x, g, c(sx, F32), c(zx, "int32"), c(sg, F32), c(zg, "int32"))  # fmt: skip
        m = bb.emit(qnn.multiply(*mul_args, c(sm, F32), c(zm, "int32"), out_dtype="int8",
                                 rounding=rounding))  # fmt: skip
        add_args = (m, x, c(sm, F32), c(zm, "int32"), c(sx, F32), c(zx, "int32")) if swap else (
            x, m, c(sx, F32), c(zx, "int32"), c(sm, F32), c(zm, "int32"))  # fmt: skip
        out = bb.emit(qnn.add(*add_args, c(so, F32), c(zo, "int32"), out_dtype=dtype,
                              rounding=rounding))  # fmt: skip
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, g, rounding, swap, out_dtype):
    (sx, zx), (sg, zg), (sm, zm), (so, zo) = _qparams(str(x.dtype))
    if swap:
        m = P.elementwise("multiply", g, sg, zg, x, sx, zx, sm, zm, "int8", rounding)
        return P.elementwise("add", m, sm, zm, x, sx, zx, so, zo, out_dtype, rounding)
    m = P.elementwise("multiply", x, sx, zx, g, sg, zg, sm, zm, "int8", rounding)
    return P.elementwise("add", x, sx, zx, m, sm, zm, so, zo, out_dtype, rounding)


def _run(mod, cpu_kernels: bool, *arrays):
    vm = relax.VirtualMachine(autoq.compile(mod, TARGET, cpu_kernels=cpu_kernels), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def _channel_luts(mod) -> int:
    with TARGET:
        main = gate_tables(mod)["main"]
    return sum(is_call(e, "qnn.lut") and e.attrs.get("axis") == 1 for _, e in bindings(main))


CASES = {
    "int8-float": ("int8", "float", False),
    "int8-float-swapped": ("int8", "float", True),
    "uint8-half_even": ("uint8", "half_even", False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gate_runs_as_run_time_channel_tables_bit_exact(case):
    dtype, rounding, swap = case
    mod = _module(dtype, rounding, swap=swap)
    assert _channel_luts(mod) == 1
    lowered = lower_to_cpu_kernels(mod, TARGET)
    assert any(gv.name_hint.startswith("autoq_lut") for gv in lowered.functions)
    rng = np.random.default_rng(0)
    lo = -128 if dtype == "int8" else 0
    # every code in every channel (256 of the 400 pixels), the rest random
    x = np.concatenate([np.tile(np.arange(lo, lo + 256), (3, 1)),
                        rng.integers(lo, lo + 256, (3, 144))], axis=1)  # fmt: skip
    x = rng.permuted(x, axis=1).astype(dtype).reshape(1, 3, 20, 20)
    g = np.array([-128, 3, 127], np.int8).reshape(1, 3, 1, 1)
    got = _run(mod, True, x, g)
    np.testing.assert_array_equal(got, _run(mod, False, x, g))
    np.testing.assert_array_equal(got, _reference(x, g, rounding, swap, dtype))
    assert len(np.unique(got)) > 40, "the case must span many output codes"


def test_small_planes_and_pixel_gates_keep_the_chain():
    assert _channel_luts(_module("int8", "float", shape=(1, 3, 16, 16))) == 0  # 256 pixels
    assert _channel_luts(_module("int8", "float", gate_shape=(1, 3, 20, 20))) == 0
