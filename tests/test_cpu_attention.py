"""autoq.cpu on the attention ops of a transformer: the row-parallel softmax (same floats as
TVM's own softmax except denormal probabilities, which are 0) and the fused reductions that
``ScheduleFused`` now schedules (matmul of two activations, int8 and float32), bit for bit
against the unscheduled kernels and numpy."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from test_cpu_kernels import PATHS  # the two ISA paths, skipped where the CPU lacks one
from tvm import relax, te

import autoq
from autoq import primitives as P
from autoq.cpu import batch_matmul as batch_matmul_mod
from autoq.cpu import epilogue as epilogue_mod
from autoq.cpu import expf as expf_mod
from autoq.cpu import softmax as softmax_mod
from autoq.cpu.batch_matmul import accumulator_bound, batch_matmul_kernel, matmul_zero_points
from autoq.cpu.epilogue import Epilogue, float64_fixed_point
from autoq.cpu.expf import EXPF_TABLE, PERMUTE_LANES, expf_expr
from autoq.cpu.injective import schedule_fused
from autoq.cpu.isa import VNNI
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.softmax import LOG_SMALLEST_NORMAL, softmax_kernel, softmax_table

TINY = np.finfo(np.float32).tiny
HOST_CPU = tvm.target.codegen.llvm_get_system_cpu()
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": HOST_CPU})


def _relax_vm(build, inputs, fuse_schedule: bool):
    """main(*inputs) = build(bb, *vars), compiled with or without autoq's CPU kernels."""
    params = [
        relax.Var(f"x{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(inputs)
    ]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        out = bb.emit(build(*params))
        bb.emit_func_output(out)
    ex = autoq.compile(bb.get(), TARGET, cpu_kernels=fuse_schedule)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


@pytest.mark.parametrize(
    ("shape", "axis"),
    [
        ((1, 3, 5, 40), -1),
        ((7, 33), -1),
        ((2, 4, 16), -1),
        ((2, 20, 48), -1),
        ((1, 16, 4, 37), 1),  # YOLOv8's box bins: 148 positions, the last 4 in scalar loops
        ((2, 6, 3, 16), 1),  # whole vectors of positions, two outer indices
        ((9, 5, 7), 0),
    ],
)
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_softmax_same_floats_except_flushed_denormals(isa, mcpu, shape, axis):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=shape) * 3).astype(np.float32)
    masked = [slice(None)] * len(shape)
    masked[axis] = slice(shape[axis] // 2, None)
    x[tuple(masked)] -= 100.0  # an attention mask: exp(-100) is denormal
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    kernel = softmax_kernel(shape, axis, permute=isa is VNNI)  # the AVX-512 path permutes
    lib = tvm.compile(tvm.IRModule({"main": kernel}), target)
    out = tvm.runtime.tensor(np.zeros(shape, np.float32))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(softmax_table()), out)
    got = out.numpy()
    ref = _relax_vm(lambda v: relax.op.nn.softmax(v, axis=axis), [x], fuse_schedule=False)
    assert np.any((ref > 0) & (ref < TINY)), "the case must contain denormal probabilities"
    normal = ref >= TINY
    np.testing.assert_array_equal(got[normal], ref[normal])
    assert not np.any(got[~normal])
    e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(axis=axis, keepdims=True), rtol=1e-5, atol=1e-30)


def _exp_lib(body, args, mcpu: str, lanes: int = 16):
    """out[i] = body(x[i]) over a flat float32 vector, vectorized by ``lanes``."""
    sch = tvm.s_tir.Schedule(te.create_prim_func([*args, body]))
    (loop,) = sch.get_loops(sch.get_sblock(body.op.name))
    sch.vectorize(sch.split(loop, [None, lanes])[1])
    return tvm.compile(sch.mod, tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))


def _exp_of(xp, table, lane):
    return lambda i: expf_expr(xp[i], table, lane(i))


@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_expf_expr_gives_libm_floats(isa, mcpu):
    """The vectorized exp == TVM's exp (a libm expf call per element), bit for bit, over
    random arguments in softmax's range and some chosen ones (integers, ln 2 multiples,
    halfway points of the k rounding, tiny magnitudes)."""
    rng = np.random.default_rng(4)
    picked = np.concatenate(
        [
            -np.arange(88, dtype=np.float32),
            -np.arange(1, 126, dtype=np.float32) * np.float32(np.log(2)),
            -(np.arange(1, 2000, dtype=np.float32) + np.float32(0.5)) * np.float32(np.log(2) / 32),
            -(np.float32(2.0) ** -np.arange(1, 149, dtype=np.float32)),
            np.array([-0.0, LOG_SMALLEST_NORMAL], np.float32),
        ]
    )
    x = np.concatenate([picked, rng.uniform(LOG_SMALLEST_NORMAL, 0, 1 << 18).astype(np.float32)])
    x = x[: len(x) // 16 * 16]
    xp = te.placeholder(x.shape, "float32", name="x")
    table = te.placeholder((32,), "int64", name="table")
    ref = _exp_lib(te.compute(x.shape, lambda i: te.exp(xp[i]), name="e"), [xp], mcpu)
    want = tvm.runtime.tensor(np.zeros_like(x))
    ref["main"](tvm.runtime.tensor(x), want)
    variants = [(lambda i: None, 16)]  # (lane of element i, vector width)
    if isa is VNNI:  # AVX-512: the table read by permutes, 8 lanes
        variants.append((lambda i: i % PERMUTE_LANES, PERMUTE_LANES))
    for lane, width in variants:
        body = te.compute(x.shape, _exp_of(xp, table, lane), name="e")
        mine = _exp_lib(body, [xp, table], mcpu, width)
        got = tvm.runtime.tensor(np.zeros_like(x))
        mine["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(EXPF_TABLE), got)
        np.testing.assert_array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32))


def test_softmax_lowered_where_covered_same_floats():
    """Every axis with a vector of positions after it runs on the kernel (axis 2 of
    ``[2, 6, 5, 4]`` has 4: TVM's own softmax); the floats are TVM's either way."""
    from autoq.cpu.lowering import lower_to_cpu_kernels

    x = np.random.default_rng(1).normal(size=(2, 6, 5, 4)).astype(np.float32)
    for axis, kernel in ((0, True), (1, True), (2, False), (-1, True)):
        bb = relax.BlockBuilder()
        v = relax.Var("x", relax.TensorType(x.shape, "float32"))
        with bb.function("main", [v]):
            bb.emit_func_output(bb.emit(relax.op.nn.softmax(v, axis=axis)))
        lowered = lower_to_cpu_kernels(bb.get(), TARGET)
        names = [gv.name_hint for gv in lowered.functions]
        assert ("autoq_softmax" in names) == kernel, (axis, names)
        got = _relax_vm(lambda v, a=axis: relax.op.nn.softmax(v, axis=a), [x], True)
        ref = _relax_vm(lambda v, a=axis: relax.op.nn.softmax(v, axis=a), [x], False)
        np.testing.assert_array_equal(got, ref)  # no denormals here: identical


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_scheduled_batch_matmul_bit_exact(dtype):
    """A matmul of two activations (attention's q @ k^T, p @ v) after ScheduleFused: vector
    accumulators, register blocked, parallel; same per-output reduction order."""
    rng = np.random.default_rng(2)
    if dtype == "int8":
        a = rng.integers(-128, 128, (1, 3, 24, 8)).astype(np.int8)
        b = rng.integers(-128, 128, (1, 3, 8, 40)).astype(np.int8)

        def build(x, y):
            return relax.op.matmul(
                relax.op.astype(x, "int32"), relax.op.astype(y, "int32"), out_dtype="int32"
            )

        want = a.astype(np.int64) @ b.astype(np.int64)
    else:
        a = rng.random((1, 3, 24, 40)).astype(np.float32)
        b = rng.normal(size=(1, 3, 40, 32)).astype(np.float32)

        def build(x, y):
            return relax.op.matmul(x, y)

        want = None
    got = _relax_vm(build, [a, b], fuse_schedule=True)
    ref = _relax_vm(build, [a, b], fuse_schedule=False)
    np.testing.assert_array_equal(got, ref)
    if want is not None:
        np.testing.assert_array_equal(got, want)


def test_schedule_fused_vectorizes_the_matmul():
    x = relax.Var("x", relax.TensorType((1, 2, 16, 8), "float32"))
    y = relax.Var("y", relax.TensorType((1, 2, 8, 32), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        out = bb.emit(relax.op.matmul(x, y))
        bb.emit_func_output(out)
    with TARGET:
        mod = relax.transform.LegalizeOps()(bb.get())
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    text = schedule_fused(func, 8).script()
    assert "T.vectorized" in text and "T.parallel" in text


# batch, M, K, N, lhs dtype, lhs zero point, rhs zero point
BATCH_MATMULS = {
    "heads": (3, 10, 8, 40, "int8", 3, -9),
    "odd-k-n": (2, 5, 7, 19, "int8", -128, 127),
    "uint8-lhs": (1, 9, 12, 16, "uint8", 131, 0),
    "zero-points-0": (2, 4, 4, 33, "int8", 0, 0),
}


@pytest.mark.parametrize("case", BATCH_MATMULS.values(), ids=BATCH_MATMULS.keys())
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_batch_matmul_kernel_bit_exact(isa, mcpu, case):
    batch, m, k, n, dt, za, zb = case
    rng = np.random.default_rng(3)
    lo, hi = (-128, 128) if dt == "int8" else (0, 256)
    a = rng.integers(lo, hi, (batch, m, k)).astype(dt)
    b = rng.integers(-128, 128, (batch, k, n)).astype(np.int8)
    a[0, 0, :] = hi - 1  # extreme rows/columns: nothing may saturate
    b[0, :, 0] = -128
    func = batch_matmul_kernel(batch, m, k, n, isa, dt)
    lib = tvm.compile(
        tvm.IRModule({"main": func}), tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    )
    want = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)
    np.testing.assert_array_equal(_run_batch_matmul(lib, a, b, za, zb), want)


def _run_batch_matmul(lib, a, b, za, zb, out_dtype="int32", table=()):
    out = tvm.runtime.tensor(np.zeros((a.shape[0], a.shape[1], b.shape[2]), out_dtype))
    zp = tvm.runtime.tensor(matmul_zero_points(za, zb))
    tables = [tvm.runtime.tensor(t) for t in table]
    lib["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), zp, *tables, out)
    return out.numpy()


@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_batch_matmul_zero_points_at_run_time(isa, mcpu):
    """One compiled kernel serves layers of any zero points (attention's 6 layers share
    it): MiniLM's q @ k^T and p @ v shapes, three zero-point pairs each."""
    rng = np.random.default_rng(5)
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    for batch, m, k, n in ((12, 128, 32, 128), (12, 128, 128, 32)):
        lib = tvm.compile(tvm.IRModule({"main": batch_matmul_kernel(batch, m, k, n, isa, "int8")}),
                          target)  # fmt: skip
        a = rng.integers(-128, 128, (batch, m, k)).astype(np.int8)
        b = rng.integers(-128, 128, (batch, k, n)).astype(np.int8)
        for za, zb in ((2, 9), (-128, -10), (127, -128)):
            want = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)
            np.testing.assert_array_equal(_run_batch_matmul(lib, a, b, za, zb), want)


@pytest.mark.parametrize("known_zero_points", [False, True])
@pytest.mark.parametrize("rounding", ["half_even", "float"])
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_batch_matmul_requantize_epilogue(isa, mcpu, rounding, known_zero_points):
    """The requantized output of each tile (``qnn.matmul -> qnn.requantize``, as attention's
    scores leave the kernel) == numpy's requantize of the exact int32 product; with the
    zero points known (as the lowering passes them) the half-even requantize runs in
    float64."""
    rng = np.random.default_rng(6)
    batch, m, k, n, za, zb = 3, 20, 32, 48, 2, 9
    a = rng.integers(-128, 128, (batch, m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (batch, k, n)).astype(np.int8)
    s_in, s_out, z_out = np.float32(0.0121), np.float32(3.3), 41
    params = (s_in, 0, s_out, z_out)
    if rounding != "float":
        mult, shift = P.quantize_multiplier(np.float64(s_in) / np.float64(s_out))
        params = (*params, int(mult), int(shift))
    epi = Epilogue(None, params, rounding, "int8", n)
    zero_points = (za, zb) if known_zero_points else None
    bound = accumulator_bound(k, "int8", za, zb)
    assert epi.exact_in_float64(bound) == (rounding == "half_even")
    func = batch_matmul_kernel(batch, m, k, n, isa, "int8", epi, zero_points)
    lib = tvm.compile(
        tvm.IRModule({"main": func}), tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    )
    got = _run_batch_matmul(lib, a, b, za, zb, "int8", [epi.table()])
    acc = ((a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)).astype(np.int32)
    want = P.requantize(acc, s_in, 0, s_out, z_out, "int8", rounding)
    assert len(np.unique(want)) > 20, "the case must span many output codes"
    np.testing.assert_array_equal(got, want)


def _float64_requantize(acc: np.ndarray, p: dict, qmin: int, qmax: int, out_dtype: str):
    """:func:`float64_fixed_point` of every int32 in ``acc`` (8 float64 lanes)."""
    x = te.placeholder(acc.shape, "int32", name="acc")
    body = te.compute(
        acc.shape, lambda i: float64_fixed_point(x[i], p, qmin, qmax, out_dtype), name="q"
    )
    got = tvm.runtime.tensor(np.zeros(acc.shape, out_dtype))
    _exp_lib(body, [x], HOST_CPU, 8)["main"](tvm.runtime.tensor(acc), got)
    return got.numpy()


@pytest.mark.parametrize(
    ("multiplier", "shift", "z_out"),
    [(1 << 30, 0, 0), (1 << 30, -3, 5), (2052733609, -8, 39), (1518500250, 2, -7)],
)
def test_float64_requantize_same_integers_ties_included(multiplier, shift, z_out):
    """The float64 half-even requantize == numpy's integer one on every accumulator of a
    range around 0 (every tie of ``m = 2**30``: x / 2, x / 16) and at the bound's ends,
    clipped to int8 and (a wide output range) not clipped."""
    bound = 1 << 21
    epi = Epilogue(None, (np.float32(1), 0, np.float32(1), z_out, multiplier, shift),
                   "half_even", "int8", 1)  # fmt: skip
    assert epi.exact_in_float64(bound)
    acc = np.concatenate([np.arange(-5000, 5000), [-bound, bound, 1 - bound, bound - 1]])
    acc = acc.astype(np.int32)
    p = {"z_in": 0, "multiplier": multiplier, "shift": shift, "z_out": z_out}
    p = {name: tvm.tirx.const(v, "int32") for name, v in p.items()}
    y = P.fixed_point_multiply(acc, multiplier, shift, "half_even") + z_out
    for qmin, qmax, dtype in ((-128, 127, "int8"), (-(2**31), 2**31 - 1, "int32")):
        got = _float64_requantize(acc, p, qmin, qmax, dtype)
        np.testing.assert_array_equal(got, np.clip(y, qmin, qmax).astype(dtype))


def test_doctests():
    for module in (softmax_mod, batch_matmul_mod, expf_mod, epilogue_mod):
        assert doctest.testmod(module).failed == 0


def test_attention_model_uses_the_kernels():
    """The realized tiny attention block lowers q @ k^T and its softmax to these kernels
    (test_cpu_kernels checks its outputs against the generic lowering, bit for bit)."""
    from models import attention

    mod, params, data = attention()
    qmod = autoq.quantize(mod, params, data(8, 1), autoq.Config(recipe="cnn"))
    names = {gv.name_hint for gv in lower_to_cpu_kernels(qmod, TARGET).functions}
    assert any(n.startswith("autoq_batch_matmul_") for n in names), sorted(names)
    assert any(n.startswith("autoq_softmax") for n in names), sorted(names)
