"""autoq.ir.fast_gelu: float32 GELU as a vectorizable kernel, in the simulated graph and the
built module alike."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from autoq.build import compile as build
from autoq.ir.fast_gelu import fast_gelu, gelu_te, reference_gelu
from autoq.ir.run import calibration_pipeline
from autoq.ir.target import default_target


def _gelu_module(dtype="float32"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 300), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.nn.gelu(relax.op.add(x, x))))
        bb.emit_func_output(y)
    return bb.get()


def test_gelu_becomes_the_kernel_call():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 300), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(x, x))
            g = bb.call_te(gelu_te, s, primfunc_name_hint="fast_gelu")
            y = bb.emit_output(g)
        bb.emit_func_output(y)
    # the rewrite leaves the old binding as a copy of the kernel's output (gv = lv1)
    after = relax.transform.CanonicalizeBindings()(fast_gelu(_gelu_module()))
    tvm.ir.assert_structural_equal(after, bb.get())


def test_other_dtypes_and_modules_without_gelu_stay():
    mod = _gelu_module("float16")
    tvm.ir.assert_structural_equal(fast_gelu(mod), mod)


def _run(mod, x, pipeline=None):
    target = default_target()
    ex = (
        build(mod, target)
        if pipeline is None
        else tvm.compile(mod, target, relax_pipeline=pipeline)
    )
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def test_values_within_6_ulp_of_erf_gelu_and_the_same_in_calibration_and_build():
    # the range where GELU is neither 0 nor x in float32, plus both tails (-10: exactly -0
    # in float64 erf terms underflows to 0; 10: x itself)
    x = np.linspace(-5, 5, 1200, dtype="float32").reshape(4, 300)
    x[0, :3] = (-10.0, 10.0, 0.0)
    built = _run(_gelu_module(), x / 2)  # the module doubles its input
    simulated = _run(_gelu_module(), x / 2, calibration_pipeline(default_target()))
    np.testing.assert_array_equal(built, simulated)
    ref = reference_gelu(x.astype(np.float64))
    err = np.abs(built - ref)
    assert err.max() < 1e-6
    # relative error only where 1 + erf does not cancel (x > 0): there within 8 ulp
    pos = x > 0.1
    assert (err[pos] / np.spacing(ref[pos].astype(np.float32))).max() <= 8
