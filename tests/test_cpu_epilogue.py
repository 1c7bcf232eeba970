"""autoq.cpu epilogue fusion: ``kernel -> add(bias) -> qnn.requantize`` chains stored as int8 /
uint8 by the packed kernels themselves, bit for bit against the generic (unfused) lowering,
for every kernel kind (conv2d, depthwise row / channel-blocked, dense; AMX conv / dense) and
instruction-set path (AVX2 via a "haswell" target on any AVX2 CPU; VNNI and AMX skipped with
the reason where the CPU lacks them), float and integer rounding modes; and the chains that
must stay unfused."""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import qnn
from autoq.cpu import amx, epilogue
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.ir.toolkit import bindings, dtype_of, is_call, shape_of

HOST = tvm.target.codegen.llvm_get_system_cpu()
FLAGS = amx.cpu_flags(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
_AMX = {"amx_tile", "amx_int8"} <= FLAGS and amx.request_amx() is None
TARGETS = [
    pytest.param(
        {"kind": "llvm", "mcpu": "haswell"},
        marks=pytest.mark.skipif("avx2" not in FLAGS, reason="this CPU has no AVX2"),
        id="avx2",
    ),
    pytest.param(
        {"kind": "llvm", "mcpu": HOST},
        marks=pytest.mark.skipif(
            "avx512_vnni" not in FLAGS, reason="this CPU has no AVX-512 VNNI (avx512_vnni)"
        ),
        id="vnni",
    ),
    pytest.param(
        {"kind": "llvm", "mcpu": HOST, "mattr": ["+amx-tile", "+amx-int8"]},
        marks=pytest.mark.skipif(
            not _AMX, reason="no AMX int8 tiles on this CPU, or Linux refuses the tile state"
        ),
        id="amx",
    ),
]
# kind, data shape, weight shape, strides, padding
CASES = {
    "conv3x3": ("conv", (1, 64, 7, 9), (40, 64, 3, 3), (1, 1), (1, 1, 1, 1)),
    "conv_strided": ("conv", (1, 24, 9, 9), (20, 24, 3, 3), (2, 2), (1, 0, 1, 1)),
    "depthwise_rows": ("depthwise", (1, 20, 40, 41), (20, 1, 3, 3), (1, 1), (1, 1, 1, 1)),
    "depthwise_blocked": ("depthwise", (1, 24, 9, 9), (24, 1, 5, 5), (2, 2), (2, 2, 2, 2)),
    "conv1x1": ("conv", (1, 64, 7, 9), (48, 64, 1, 1), (1, 1), (0, 0, 0, 0)),
    "dense": ("dense", (3, 12, 96), (40, 96), None, None),
    "matmul": ("matmul", (2, 12, 32), (20, 32), None, None),  # q @ k^T: weight shape (n, k)
}


def _chain(case, rounding="float", out_dtype="int8", per_channel=True, bias=True, seed=0, odd=None):
    """main(x) = requantize(kernel(x) [+ bias]) with random per-channel scales; ``odd``:
    "output" also returns the int32 accumulator, "axis" gives the requantize per-axis
    parameters along axis 1 of a dense output (its rows, not the channels), "two"
    requantizes the accumulator twice (other output qparams) and concatenates both along
    the channels (YOLOv8's head convs, read by two concats)."""
    kind, x_shape, w_shape, strides, padding = CASES[case]
    rng = np.random.default_rng(seed)
    x = relax.Var("x", relax.TensorType(x_shape, "int8"))
    w = relax.const(rng.integers(-128, 128, w_shape).astype(np.int8))
    oc = w_shape[0]
    qx = [relax.const(np.float32(0.02)), relax.const(np.int32(-7))]
    qw = [relax.const(np.full(oc, 0.01, np.float32)), relax.const(np.zeros(oc, np.int32))]
    bb = relax.BlockBuilder()
    params = [x]
    if kind == "matmul":
        params.append(relax.Var("y", relax.TensorType((*x_shape[:-2], *w_shape[::-1]), "int8")))
    with bb.function("main", params):
        with bb.dataflow():
            if kind == "matmul":
                qy = [relax.const(np.float32(0.01)), relax.const(np.int32(3))]
                acc = bb.emit(qnn.matmul(x, params[1], *qx, *qy))
                bias_shape, axis = (oc,), -1
            elif kind == "dense":
                acc = bb.emit(qnn.dense(x, w, *qx, *qw))
                bias_shape, axis = (oc,), -1
            else:
                groups = x_shape[1] if kind == "depthwise" else 1
                call = qnn.conv2d(x, w, *qx, *qw, strides, padding, groups=groups)
                acc, bias_shape, axis = bb.emit(call), (1, oc, 1, 1), 1
            if bias:
                b = rng.integers(-5000, 5000, bias_shape).astype(np.int32)
                acc = bb.emit(relax.op.add(acc, relax.const(b)))
            n = oc if per_channel else 1
            if odd == "axis":
                n, axis = x_shape[1], 1
            s_in = relax.const(rng.uniform(1e-4, 3e-4, n).astype(np.float32))
            z_out = -125 if out_dtype == "int8" else 3
            req = qnn.requantize(
                acc, s_in, relax.const(np.zeros(n, np.int32)), relax.const(np.float32(0.05)),
                relax.const(np.int32(z_out)), axis=axis, out_dtype=out_dtype, rounding=rounding,
            )  # fmt: skip
            out = bb.emit(req)
            if odd == "two":
                again = qnn.requantize(
                    acc, s_in, relax.const(np.zeros(n, np.int32)), relax.const(np.float32(0.03)),
                    relax.const(np.int32(11)), axis=axis, out_dtype=out_dtype, rounding=rounding,
                )  # fmt: skip
                out = bb.emit(relax.op.concat([out, bb.emit(again)], axis=axis))
            out = bb.emit_output(relax.Tuple([out, acc]) if odd == "output" else out)
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]}), x_shape


def _fused(mod, target) -> bool:
    """Whether the lowered module requantizes inside the kernel (no requantize function)."""
    names = [gv.name_hint for gv in lower_to_cpu_kernels(mod, target).functions]
    return not any("requantize" in n for n in names) and any(n.startswith("autoq") for n in names)


def _same_as_generic(mod, x_shape, target):
    rng = np.random.default_rng(1)
    shapes = [shape_of(p) for p in mod["main"].params]
    xs = [tvm.runtime.tensor(rng.integers(-128, 128, s).astype(np.int8)) for s in shapes]
    outs = []
    for kernels in (True, False):
        ex = autoq.compile(mod, target, cpu_kernels=kernels)
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](*xs).numpy())
    assert outs[0].dtype == outs[1].dtype
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_epilogue_same_as_generic(target, case):
    target = tvm.target.Target(target)
    mod, x_shape = _chain(case)
    assert _fused(mod, target)
    _same_as_generic(mod, x_shape, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("case", "rounding", "out_dtype", "per_channel", "bias"),
    [
        ("conv3x3", "tflite", "int8", True, True),
        ("conv3x3", "half_even", "uint8", False, False),
        ("dense", "half_away", "uint8", True, False),
        ("depthwise_rows", "tflite_single", "int8", False, True),
        ("matmul", "half_even", "int8", False, False),
    ],
)
def test_fused_epilogue_variants(target, case, rounding, out_dtype, per_channel, bias):
    target = tvm.target.Target(target)
    mod, x_shape = _chain(case, rounding, out_dtype, per_channel, bias, seed=2)
    assert _fused(mod, target)
    _same_as_generic(mod, x_shape, target)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("case", "rounding"), [("conv1x1", "float"), ("conv3x3", "half_even"), ("dense", "float")]
)
def test_accumulator_read_by_two_requantizes_fuses_into_two_kernels(target, case, rounding):
    """Each requantize of a biased accumulator read only by requantizes gets its own kernel
    call storing int8 (the int32 tensor is never written), bit for bit."""
    target = tvm.target.Target(target)
    mod, x_shape = _chain(case, rounding, odd="two", seed=3)
    assert _fused(mod, target)
    lowered = lower_to_cpu_kernels(mod, target)
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    kernels = [c for c in calls if c.args[0].name_hint.startswith("autoq")]
    assert len(kernels) == 2 and all(dtype_of(c) == "int8" for c in kernels)
    _same_as_generic(mod, x_shape, target)


@pytest.mark.parametrize("odd", ["output", "axis"])
def test_chains_the_kernels_cannot_fuse_stay_unfused(odd):
    mod, x_shape = _chain("dense" if odd == "axis" else "conv3x3", odd=odd)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert not _fused(mod, target)
    if odd == "axis":
        _same_as_generic(mod, x_shape, target)


def _four_blocks(rounding: str, per_channel: bool):
    """main(x) = four conv3x3 -> add(bias) -> requantize blocks of one shape (16 -> 16
    channels, each block reading the previous one's output, zero point -7) with different
    weights, biases, scales and output zero points."""
    rng = np.random.default_rng(3)
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            h = x
            for s_out, z_out in ((0.05, -7), (0.03, -7), (0.04, -7), (0.06, 5)):
                w = relax.const(rng.integers(-128, 128, (16, 16, 3, 3)).astype(np.int8))
                qw = [
                    relax.const(np.full(16, 0.01, np.float32)),
                    relax.const(np.zeros(16, "int32")),
                ]
                z_in = -7  # (the first three blocks' output zero point)
                q_in = [relax.const(np.float32(0.02)), relax.const(np.int32(z_in))]
                acc = bb.emit(qnn.conv2d(h, w, *q_in, *qw, (1, 1), (1, 1, 1, 1)))
                b = rng.integers(-5000, 5000, (1, 16, 1, 1)).astype(np.int32)
                acc = bb.emit(relax.op.add(acc, relax.const(b)))
                s_in = rng.uniform(1e-4, 3e-4, 16 if per_channel else 1).astype(np.float32)
                req = qnn.requantize(
                    acc, relax.const(s_in), relax.const(np.zeros(s_in.size, np.int32)),
                    relax.const(np.float32(s_out)), relax.const(np.int32(z_out)), axis=1,
                    out_dtype="int8", rounding=rounding,
                )  # fmt: skip
                h = bb.emit(req)
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


@pytest.mark.parametrize("target", TARGETS[:2])
@pytest.mark.parametrize(("rounding", "per_channel"), [("float", True), ("tflite", False)])
def test_layers_of_one_shape_share_one_kernel(target, rounding, per_channel):
    # the epilogue's values are table rows, not immediates: the second and third blocks
    # (both reading and writing the blocked layout) call one PrimFunc; the first (reading
    # NCHW) and the last (writing NCHW) their own
    target = tvm.target.Target(target)
    mod = _four_blocks(rounding, per_channel)
    lowered = lower_to_cpu_kernels(mod, target)
    kernels = [gv.name_hint for gv in lowered.functions if gv.name_hint.startswith("autoq")]
    calls = [
        b.value.args[0].name_hint
        for block in lowered["main"].body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"
    ]
    assert len(kernels) == 3, kernels
    assert len(calls) == 4 and calls[1] == calls[2]
    _same_as_generic(mod, (1, 16, 8, 8), target)


def _round_clip_reference(u, z, qmin, qmax):
    """The float requantize's tail as quantize_value computes it, in numpy float32."""
    v = np.rint(u).astype(np.float32) + z.astype(np.float32)
    return np.clip(v, np.float32(qmin), np.float32(qmax))


@pytest.mark.parametrize("out_dtype", ["int8", "uint8"])
@pytest.mark.parametrize("target", TARGETS[:2])
def test_round_clip_matches_the_float_requantize(target, out_dtype):
    """round_clip (clamp, then one round-half-even conversion) against the float path it
    replaces, on halves, values at and next to the clamp bounds, values whose sum with the
    zero point is inexact in float32 and the float32 extremes, every zero point."""
    from tvm import te

    qmin, qmax = (-128, 127) if out_dtype == "int8" else (0, 255)
    zs = np.arange(qmin, qmax + 1, dtype=np.int32)
    base = np.array([0.0, 0.5, 1.5, 2.5, 0.49999997, 1e9, 2.0**24 + 2, 2.0**31, 3e38], np.float32)
    base = np.concatenate([base, -base])
    edges = np.array([[qmin - z, qmax - z] for z in zs], np.float32).reshape(-1)
    near = np.concatenate([edges + d for d in (-0.5, -0.25, 0.0, 0.25, 0.5, 1.0, -1.0)])
    u = np.concatenate([base, near, np.random.default_rng(0).normal(0, 200, 4096)])
    u = u.astype(np.float32)
    u2 = np.repeat(u[None], len(zs), axis=0)  # every value with every zero point
    z2 = np.repeat(zs[:, None], len(u), axis=1)
    ut = te.placeholder(u2.shape, "float32", name="u")
    zt = te.placeholder(z2.shape, "int32", name="z")
    out = te.compute(
        u2.shape,
        lambda i, j: epilogue.round_clip(ut[i, j], zt[i, j], qmin, qmax, out_dtype),
        name="out",
    )
    sch = tvm.s_tir.Schedule(te.create_prim_func([ut, zt, out]))
    _, ji = sch.split(sch.get_loops(sch.get_sblock("out"))[1], [None, 16])
    sch.vectorize(ji)
    lib = tvm.compile(sch.mod, tvm.target.Target(target))
    got = tvm.runtime.tensor(np.zeros(u2.shape, out_dtype))
    lib["main"](tvm.runtime.tensor(u2), tvm.runtime.tensor(z2), got)
    want = _round_clip_reference(u2, z2, qmin, qmax).astype(out_dtype)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("rounded", [True, False])
@pytest.mark.parametrize("target", TARGETS[:2])
def test_saturate_int32_matches_the_float64_clip(target, rounded):
    """saturate_int32 (float32 lanes) against the float64 clip of the qnn.requantize
    legalization, at and around both int32 bounds and on ordinary values; ``rounded=False``
    also on values it rounds (half to even: the ties 0.5, 2.5 and -1.5 included)."""
    from tvm import te

    top = np.float32(2.0**31)
    around = [np.nextafter(top, np.float32(0)), top, np.nextafter(top, np.float32(np.inf))]
    v = np.array([0, 1, -1, 2.0**24, 3e38, *around], np.float32)
    v = np.concatenate([v, -v, np.rint(np.random.default_rng(1).normal(0, 2e9, 4096))])
    if not rounded:
        ties = [0.5, 2.5, -1.5, 2.0**22 + 0.5, 0.49999997]
        v = np.concatenate([v, ties, np.random.default_rng(2).normal(0, 1e3, 4096)])
    v = v.astype(np.float32)
    vt = te.placeholder(v.shape, "float32", name="v")
    out = te.compute(v.shape, lambda i: epilogue.saturate_int32(vt[i], rounded), name="out")
    sch = tvm.s_tir.Schedule(te.create_prim_func([vt, out]))
    _, ii = sch.split(sch.get_loops(sch.get_sblock("out"))[0], [None, 16])
    sch.vectorize(ii)
    lib = tvm.compile(sch.mod, tvm.target.Target(target))
    got = tvm.runtime.tensor(np.zeros(v.shape, np.int32))
    lib["main"](tvm.runtime.tensor(v), got)
    want = np.clip(np.rint(v.astype(np.float64)), -(2.0**31), 2.0**31 - 1).astype(np.int32)
    np.testing.assert_array_equal(got.numpy(), want)


def test_doctests():
    assert doctest.testmod(epilogue).failed == 0


def _epilogue_values(e: epilogue.Epilogue, acc: np.ndarray, saturates: bool = True) -> np.ndarray:
    """``e`` applied to ``acc[channel, i]`` (int32 accumulators, or ``e.codes``) by a kernel
    for this CPU (16 lanes)."""
    from tvm import te

    at = te.placeholder(acc.shape, str(acc.dtype), name="acc")
    tt = te.placeholder(e.table().shape, "int32", name="table")
    out = te.compute(
        acc.shape,
        lambda c, i: e.value(at[c, i], c, lambda r, k: tt[r, k], saturates),
        name="out",
    )
    sch = tvm.s_tir.Schedule(te.create_prim_func([at, tt, out]))
    _, ii = sch.split(sch.get_loops(sch.get_sblock("out"))[1], [None, 16])
    sch.vectorize(ii)
    lib = tvm.compile(sch.mod, tvm.target.Target({"kind": "llvm", "mcpu": HOST}))
    res = tvm.runtime.tensor(np.zeros(acc.shape, e.out_dtype))
    lib["main"](tvm.runtime.tensor(acc), tvm.runtime.tensor(e.table()), res)
    return res.numpy()


@pytest.mark.parametrize("out_dtype", ["int8", "int32"])
@pytest.mark.parametrize("s_out", [0.05, 1.99999988, 0.0123, 3.0])
def test_reciprocal_epilogue_is_the_division(s_out, out_dtype):
    """The float requantize dividing by a reciprocal product with FMA corrections
    (Epilogue.reciprocal, the AMX targets' epilogues) against the division epilogue and the
    numpy requantize, compiled for this CPU, on random, small and extreme int32
    accumulators, per-channel input scales (s_out 1.99999988: two corrections)."""
    from autoq import primitives as P

    channels = 4
    rng = np.random.default_rng(7)
    s_in = rng.uniform(1e-5, 3e-3, channels).astype(np.float32)
    z_out = 0 if out_dtype == "int32" else -3
    params = (s_in, 0, np.float32(s_out), z_out)
    acc = np.concatenate(
        [
            rng.integers(-(2**31), 2**31, 20_000),
            np.arange(-20_000, 20_000),
            2**31 - 1 - np.arange(200),
            -(2**31) + np.arange(200),
        ]
    ).astype(np.int32)
    acc = np.repeat(acc[None], channels, axis=0)
    got = {}
    for reciprocal in (False, True):
        e = epilogue.Epilogue(None, params, "float", out_dtype, channels, reciprocal)
        steps = e.division_steps()
        assert steps == 0 if not reciprocal else steps == 2 or (s_out != 1.99999988 and steps == 1)
        got[reciprocal] = _epilogue_values(e, acc)
    np.testing.assert_array_equal(got[True], got[False])
    real = acc.astype(np.float32) * s_in[:, None]
    want = P.quantize(real, np.float32(s_out), z_out, out_dtype)
    np.testing.assert_array_equal(got[True], want)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("tiny", [False, True])
def test_shortcut_term_on_codes_is_the_requantize(dtype, tiny):
    """A residual's shortcut term (``Epilogue.codes``: 8-bit codes onto an accumulator grid
    of zero point 0, rounded by the conversion, corrections counted on the 256 codes)
    against the numpy requantize on every code; per-channel output scales of the worst
    reciprocal (mantissa all ones: two corrections in general, one on these codes) and
    ordinary ones; ``tiny``: one channel's scale 3e-12 saturates the int32 term (without it
    the kernel skips the clip, ``Residual.saturates``)."""
    from autoq import primitives as P
    from autoq.cpu.residual import Residual

    rng = np.random.default_rng(3)
    s_out = np.concatenate([[1.99999988 * 2.0**-17], rng.uniform(1e-6, 1e-4, 7)])
    if tiny:
        s_out[3] = 3e-12
    s_out = s_out.astype(np.float32)
    s_in, z_in = np.float32(0.0064), -128 if dtype == "int8" else 7
    e = epilogue.Epilogue(None, (s_in, z_in, s_out, 0), "float", "int32", 8, True, dtype)
    assert e.division_steps() == 1
    assert P.reciprocal_division_steps(s_out, s_in) == 2
    saturates = Residual(e, dtype).saturates
    assert saturates == tiny
    lo, hi = P.qrange(dtype)
    codes = np.repeat(np.arange(lo, hi + 1)[None], 8, axis=0).astype(dtype)
    got = _epilogue_values(e, codes, saturates)
    want = P.requantize(codes, s_in, z_in, s_out, 0, "int32", axis=0)
    np.testing.assert_array_equal(got, want)
