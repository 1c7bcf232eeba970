"""autoq.ir.any_shape: calibration's elementwise binary ops compile to one kernel per rank and
broadcast, and compute numpy's bits (float32 / int32, equal shapes, broadcasts, scalar
constants, fewer dimensions on one side)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq.ir.any_shape as any_shape
from autoq.ir.run import calibration_pipeline

TARGET = tvm.target.Target({"kind": "llvm"})
OPS = {
    "relax.add": (relax.op.add, np.add),
    "relax.subtract": (relax.op.subtract, np.subtract),
    "relax.multiply": (relax.op.multiply, np.multiply),
    "relax.divide": (relax.op.divide, np.divide),
}
#: (x shape, y shape or a scalar constant, dtype)
CASES = {
    "same": ((2, 3, 5, 7), (2, 3, 5, 7), "float32"),
    "channels": ((1, 8, 5, 6), (1, 8, 1, 1), "float32"),
    "rank": ((4, 6, 16), (16,), "float32"),
    "both_broadcast": ((3, 1), (1, 5), "float32"),
    "scalar_const": ((2, 9, 4), "const", "float32"),
    "int32": ((3, 17), (1, 17), "int32"),
}


def _data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == "int32":
        return rng.integers(1, 50, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype) + np.asarray(3.0, dtype)  # (no zero divisor)


def _module(op, x_shape, y_shape, dtype):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(x_shape), dtype))
    params = [x]
    if y_shape == "const":
        y = relax.const(np.asarray(1.7, dtype), dtype)
    else:
        y = relax.Var("y", relax.TensorType(list(y_shape), dtype))
        params.append(y)
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(op(x, y))
        bb.emit_func_output(out)
    return bb.get()


def test_doctests():
    assert doctest.testmod(any_shape).failed == 0


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(OPS))
def test_kernels_compute_numpys_bits(name, case):
    x_shape, y_shape, dtype = CASES[case]
    if dtype == "int32" and name == "relax.divide":
        pytest.skip("relax.divide is a float op")
    op, ref = OPS[name]
    x = _data(x_shape, dtype, 1)
    y = np.asarray(1.7, dtype) if y_shape == "const" else _data(y_shape, dtype, 2)
    mod = _module(op, x_shape, y_shape, dtype)
    ex = tvm.compile(mod, TARGET, relax_pipeline=calibration_pipeline(TARGET))
    vm = relax.VirtualMachine(ex.jit(), tvm.cpu())
    args = [x] if y_shape == "const" else [x, y]
    got = vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    np.testing.assert_array_equal(got, ref(x, y).astype(dtype))


def test_one_kernel_per_rank_and_broadcast():
    """Adds on three shapes of one broadcast (and one of another) call two kernels; TVM's own
    legalization compiles one per shape."""
    bb = relax.BlockBuilder()
    xs = [
        relax.Var(f"x{k}", relax.TensorType([1, c, c, c], "float32"))
        for k, c in enumerate((4, 8, 16))
    ]
    z = relax.Var("z", relax.TensorType([2, 3, 5, 5], "float32"))
    with bb.function("main", [*xs, z]):
        with bb.dataflow():
            outs = [
                bb.emit(
                    relax.op.add(
                        x, relax.const(np.ones((1, int(x.ty.shape.values[1]), 1, 1), "float32"))
                    )
                )
                for x in xs
            ]
            outs.append(bb.emit(relax.op.add(z, z)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    mod = bb.get()

    def kernels(m):
        return [gv for gv, f in m.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]

    assert len(kernels(relax.transform.LegalizeOps(any_shape.legalize_map())(mod))) == 2
    assert len(kernels(relax.transform.LegalizeOps()(mod))) == 4
