"""autoq.cpu.int8_round_trip: the fused float-rounding int8 chains without their int8 round
trips, bit for bit against the generic lowering (open_nsfw's downsampling block on the VNNI,
AVX2 and AMX targets) and against the same TE function built unscheduled (every pair of int8
inputs); a clip outside the int8 range keeps its casts."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_cpu_amx import AMX_TARGET, needs_amx
from test_cpu_blocked import TARGETS
from test_cpu_residual import X_SHAPE, _elementwise_module, _run
from tvm import te

from autoq.cpu.injective import schedule_fused

_CASES = [*TARGETS, pytest.param(AMX_TARGET, id="amx", marks=needs_amx)]


@pytest.mark.parametrize("target", _CASES)
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_downsampling_block_bit_exact(target, dtype):
    mod = _elementwise_module(dtype, "float")
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    x = np.random.default_rng(5).integers(lo, hi + 1, X_SHAPE).astype(dtype)
    got = _run(mod, target, x)
    np.testing.assert_array_equal(got, _run(mod, target, x, cpu_kernels=False))


def _chain(hi: float):
    """int8 ``a`` and ``b`` quantized to int8 (clip to ``[-128, hi]``), read back with a zero
    point, added and quantized again: the shape of two fused qnn float stages."""
    a = te.placeholder((256, 256), "int8", name="a")
    b = te.placeholder((256, 256), "int8", name="b")

    def stage(x, s, z):
        v = te.round(x / np.float32(s)) + np.float32(z)
        return te.max(te.min(v, np.float32(hi)), np.float32(-128.0)).astype("int8")

    def g(i, j):
        ra = (a[i, j].astype("int32") - 3).astype("float32") * np.float32(0.0127)
        q = stage(ra + b[i, j].astype("float32") * np.float32(0.0024), 0.011, -38)
        r = (q.astype("int32") + 38).astype("float32") * np.float32(0.011)
        return stage(r, 0.0086, 5)

    out = te.compute((256, 256), g, name="out")
    return te.create_prim_func([a, b, out])


def _build(func):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), "llvm")


@pytest.mark.parametrize(("hi", "elided"), [(127.0, True), (300.0, False)])
def test_round_trips_elided_bit_exact(hi, elided):
    func = _chain(hi)
    scheduled = schedule_fused(func)
    assert scheduled.script().count('T.Cast("int8"') == (1 if elided else 2)
    a, b = np.meshgrid(np.arange(-128, 128), np.arange(-128, 128), indexing="ij")
    args = [tvm.runtime.tensor(v.astype("int8")) for v in (a, b)]
    outs = []
    for f in (func, scheduled):
        out = tvm.runtime.tensor(np.zeros((256, 256), "int8"))
        _build(f)["main"](*args, out)
        outs.append(out.numpy())
    np.testing.assert_array_equal(outs[1], outs[0])
