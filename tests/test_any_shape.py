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
from autoq import qnn
from autoq.ir import canonicalize
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

    assert len(_kernels(relax.transform.LegalizeOps(any_shape.legalize_map())(mod))) == 2
    assert len(_kernels(relax.transform.LegalizeOps()(mod))) == 4


def _f32(a):
    return np.asarray(a, np.float32)


#: op -> (build the call from x, the numpy reference in float32 steps, exact reference or rtol)
UNARY = {
    "relax.astype": (lambda x: relax.op.astype(x, "int32"), lambda x: x.astype("int32"), 0),
    "relax.nn.relu": (relax.op.nn.relu, lambda x: np.maximum(x, _f32(0)), 0),
    "relax.sigmoid": (relax.op.sigmoid, lambda x: 1 / (1 + np.exp(-x.astype("float64"))), 1e-6),
    "relax.clip": (lambda x: relax.op.clip(x, 0.0, 1.0), lambda x: np.clip(x, _f32(0), _f32(1)), 0),
    "autoq.hardswish": (
        canonicalize.hardswish,
        lambda x: x * (np.clip(x + _f32(3), _f32(0), _f32(6)) / _f32(6)),
        0,
    ),
    "autoq.hardsigmoid": (
        canonicalize.hardsigmoid,
        lambda x: np.clip(x + _f32(3), _f32(0), _f32(6)) / _f32(6),
        0,
    ),
}
UNARY_SHAPES = {"nchw": (2, 3, 5, 7), "channels": (1, 8, 1, 1), "rank1": (16,), "scalar": ()}


def _run(mod, args, pipeline):
    ex = tvm.compile(mod, TARGET, relax_pipeline=pipeline)
    vm = relax.VirtualMachine(ex.jit(), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _unary_module(op, shapes):
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{k}", relax.TensorType(list(s), "float32")) for k, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(relax.Tuple([op(x) for x in xs]) if len(xs) > 1 else op(xs[0]))
        bb.emit_func_output(out)
    return bb.get()


def test_unary_table_is_the_test_table():
    assert sorted(any_shape.UNARY) == sorted(UNARY)


@pytest.mark.parametrize("shape", sorted(UNARY_SHAPES))
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_kernels_compute_tvms_and_numpys_bits(name, shape):
    op, ref, rtol = UNARY[name]
    x = (np.random.default_rng(3).normal(size=UNARY_SHAPES[shape]) * 4).astype("float32")
    mod = _unary_module(op, [UNARY_SHAPES[shape]])
    got = _run(mod, [x], calibration_pipeline(TARGET))
    np.testing.assert_array_equal(got, _run(mod, [x], "default"))
    if rtol:
        np.testing.assert_allclose(got, ref(x), rtol=rtol)
    else:
        np.testing.assert_array_equal(got, ref(x))


@pytest.mark.parametrize("name", sorted(UNARY))
def test_one_unary_kernel_per_rank(name):
    """Three shapes of one rank call one kernel (TVM's legalization: three), another rank one
    more; a clip with other bounds is another kernel."""
    op = UNARY[name][0]
    mod = _unary_module(op, [(1, 8, 4, 4), (1, 16, 1, 1), (2, 3, 5, 5), (7,)])
    assert len(_kernels(relax.transform.LegalizeOps(any_shape.legalize_map())(mod))) == 2
    assert len(_kernels(relax.transform.LegalizeOps()(mod))) == 4


def test_clip_bounds_stay_immediates():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3], "float32"))
    y = relax.Var("y", relax.TensorType([4, 5], "float32"))
    with bb.function("main", [x, y]):
        outs = [relax.op.clip(x, 0.0, 1.0), relax.op.clip(y, 0.0, 1.0), relax.op.clip(y, -1.0, 6.0)]
        bb.emit_func_output(relax.Tuple(outs))
    low = relax.transform.LegalizeOps(any_shape.legalize_map())(bb.get())
    assert len(_kernels(low)) == 2
    xv = np.linspace(-3, 8, 6, dtype="float32").reshape(2, 3)
    yv = np.linspace(-3, 8, 20, dtype="float32").reshape(4, 5)
    ex = tvm.compile(bb.get(), TARGET, relax_pipeline=calibration_pipeline(TARGET))
    got = relax.VirtualMachine(ex.jit(), tvm.cpu())["main"](
        tvm.runtime.tensor(xv), tvm.runtime.tensor(yv)
    )
    np.testing.assert_array_equal(got[0].numpy(), np.clip(xv, 0, 1))
    np.testing.assert_array_equal(got[1].numpy(), np.clip(yv, 0, 1))
    np.testing.assert_array_equal(got[2].numpy(), np.clip(yv, -1, 6))


def _kernels(m):
    return [gv for gv, f in m.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


def _sim_module(cases):
    """One simulated quantize -> dequantize per (shape, scale, zero point, axis) case."""
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{k}", relax.TensorType(list(c[0]), "float32")) for k, c in enumerate(cases)]
    with bb.function("main", xs):
        with bb.dataflow():
            outs = []
            for x, (_, s, z, axis) in zip(xs, cases, strict=True):
                s, z = relax.const(_f32(s)), relax.const(np.asarray(z, "int32"))
                q = bb.emit(qnn.simulated_quantize(x, s, z, axis=axis))
                outs.append(bb.emit(qnn.simulated_dequantize(q, s, z, axis=axis)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


#: (shape, scale, zero point, axis): per tensor on 4 shapes (3 scales), per channel on 2
SIM_CASES = [
    ((1, 8, 6, 6), 0.05, 3, -1),
    ((1, 8, 1, 1), 0.02, -5, -1),
    ((2, 1, 3, 4), 0.05, 0, -1),
    ((1, 1, 1, 1), 0.125, 7, -1),
    ((1, 4, 3, 3), [0.1, 0.02, 0.03, 0.5], [0, 1, -2, 3], 1),
    ((2, 3, 1, 1), [0.1, 0.02, 0.03], [0, 0, 0], 1),
]


def test_simulated_qdq_one_kernel_per_rank_and_parameter_kind():
    """Per-tensor qparams of any value and data of any shape of a rank share one quantize and
    one dequantize; per-channel ones (axis 1) one more each. The values are numpy's."""
    mod = _sim_module(SIM_CASES)
    with TARGET:
        low = calibration_pipeline(TARGET)(mod)
    names = sorted(gv.name_hint for gv in _kernels(low))
    assert names == [
        "qnn_sim_dequantize",
        "qnn_sim_dequantize1",
        "qnn_sim_quantize",
        "qnn_sim_quantize1",
    ]
    rng = np.random.default_rng(5)
    xs = [(rng.normal(size=c[0]) * 3).astype("float32") for c in SIM_CASES]
    ex = tvm.compile(mod, TARGET, relax_pipeline=calibration_pipeline(TARGET))
    got = relax.VirtualMachine(ex.jit(), tvm.cpu())["main"](*[tvm.runtime.tensor(x) for x in xs])
    for x, g, (shape, s, z, axis) in zip(xs, got, SIM_CASES, strict=True):
        view = [1] * len(shape)
        s, z = _f32(s), np.asarray(z, "int32")
        if s.ndim:
            view[axis] = -1
            s, z = s.reshape(view), z.reshape(view)
        q = np.clip(np.round(x / s) + z.astype("float32"), -128, 127)
        np.testing.assert_array_equal(g.numpy(), (q - z.astype("float32")) * s)
