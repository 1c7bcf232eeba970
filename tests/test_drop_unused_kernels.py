"""autoq.ir.cpu_pipeline.drop_unused_kernels: the reshape kernels that the dataflow lowering
turns into views are not compiled (calibration's pipeline and the exported library's), and
the compiled graph computes what numpy computes."""

from __future__ import annotations

import doctest

import numpy as np
import tvm
from tvm import relax

import autoq.ir.cpu_pipeline as cpu_pipeline
from autoq.build import compile as build_compile
from autoq.ir.run import calibration_pipeline

TARGET = tvm.target.Target({"kind": "llvm"})


def _module():
    """``main(x) = reshape(x + 1, (6, 4)) * 2``: the reshape becomes a view when lowered."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3, 4], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, relax.const(1.0, "float32")))
            z = bb.emit(relax.op.reshape(y, (6, 4)))
            out = bb.emit_output(relax.op.multiply(z, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> list[str]:
    return sorted(
        gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    )


def test_doctests():
    assert doctest.testmod(cpu_pipeline).failed == 0


def test_calibration_pipeline_compiles_only_called_kernels():
    with TARGET:
        lowered = calibration_pipeline(TARGET)(_module())
    kernels = _kernels(lowered)
    assert kernels and not [k for k in kernels if k.startswith("reshape")]
    script = lowered["main"].script()  # every kernel left is called there
    assert all(f"{k}(" in script for k in kernels)
    # without the drop, TVM's lowering leaves the reshape kernel behind (the case it is for)
    with TARGET:
        kept = tvm.transform.Sequential(
            [relax.transform.LegalizeOps(), relax.transform.RewriteDataflowReshape()]
        )(_module())
    assert [k for k in _kernels(kept) if k.startswith("reshape")]


def test_compiled_graphs_match_numpy():
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    want = ((x + np.float32(1)).reshape(6, 4) * np.float32(2)).astype("float32")
    for ex in (
        tvm.compile(_module(), TARGET, relax_pipeline=calibration_pipeline(TARGET)),
        build_compile(_module(), TARGET),
    ):
        vm = relax.VirtualMachine(ex.jit(), tvm.cpu())
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), want)
