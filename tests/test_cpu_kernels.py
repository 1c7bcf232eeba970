"""autoq.cpu: the packed, tensorized int8 kernels against a numpy int64 reference, for both
instruction-set paths (VNNI where the CPU has it, AVX2 on any AVX2 CPU via a "haswell"
target), their selection from the target, and whole realized models compiled with the
kernels (``autoq.compile(cpu_kernels=True)``) against the generic lowering, bit for bit."""

from __future__ import annotations

import doctest
import functools
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config, qnn
from autoq.cpu import depthwise, injective, packing, tiling
from autoq.cpu import isa as isa_mod
from autoq.cpu import lut as lut_mod
from autoq.cpu.conv2d import ConvBlocking, ConvShape, conv2d_kernel, register_tile
from autoq.cpu.dense import dense_kernel
from autoq.cpu.depthwise import blocked, depthwise_kernel, depthwise_weight
from autoq.cpu.injective import schedule_fused
from autoq.cpu.isa import AVX2, VNNI, isa_of
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.lut import lut_kernel, vbmi_lut_kernel
from autoq.qnn.lut import lut
from models import attention, mlp, small_cnn


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


FLAGS = _cpu_flags()
HOST = tvm.target.codegen.llvm_get_system_cpu()
PATHS = [
    pytest.param(
        VNNI,
        HOST,
        marks=pytest.mark.skipif(
            "avx512_vnni" not in FLAGS, reason="this CPU has no AVX-512 VNNI (avx512_vnni)"
        ),
        id="vnni",
    ),
    pytest.param(
        AVX2,
        "haswell",
        marks=pytest.mark.skipif("avx2" not in FLAGS, reason="this CPU has no AVX2"),
        id="avx2",
    ),
]


def _target(mcpu: str) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu})


def _run(func, mcpu, args, out_shape):
    lib = tvm.compile(tvm.IRModule({"main": func}), _target(mcpu))
    out = tvm.runtime.tensor(np.zeros(out_shape, np.int32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


def conv_reference(x, w, zx, strides, padding, dilation):
    """int64 conv2d(x - zx, w), NCHW / OIHW, padding (top, left, bottom, right) of real 0."""
    pt, pl, pb, pr = padding
    xc = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    (sh, sw), (dh, dw), (_, _, kh, kw) = strides, dilation, w.shape
    oh = (xc.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xc.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            patch = xc[
                :,
                :,
                i * dh : i * dh + sh * (oh - 1) + 1 : sh,
                j * dw : j * dw + sw * (ow - 1) + 1 : sw,
            ]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j].astype(np.int64))
    return out


def _data(rng, shape, dtype):
    lo, hi = (-128, 128) if dtype == "int8" else (0, 256)
    return rng.integers(lo, hi, shape).astype(dtype)


# batch, IC, H, W, OC, kernel, stride, padding, dilation, data dtype, zero point
CONVS = {
    "3x3": (1, 16, 9, 10, 32, 3, 1, (1, 1, 1, 1), 1, "int8", 3),
    "1x1-odd-channels": (2, 6, 5, 7, 20, 1, 1, (0, 0, 0, 0), 1, "int8", -128),
    "3x3-stride2": (1, 24, 11, 11, 16, 3, 2, (1, 1, 1, 1), 1, "uint8", 131),
    "7x7-stem": (1, 3, 20, 20, 16, 7, 2, (3, 3, 3, 3), 1, "int8", -7),
    "asym-pad-dilated": (1, 8, 9, 13, 8, 3, 1, (0, 2, 1, 0), 2, "int8", 0),
    # a CONV_BLOCKINGS row on VNNI: 5 columns (14 padded to 15) x 4 lane blocks
    "1x1-wide-blocking": (1, 40, 3, 14, 64, 1, 1, (0, 0, 0, 0), 1, "uint8", 9),
    "1x1-stride2-wide-blocking": (1, 16, 5, 56, 128, 1, 2, (0, 0, 0, 0), 1, "int8", -3),
}


def test_wide_blocking_cases_use_the_row():
    """The two wide-blocking cases above take the 4-lane-block tile on VNNI, the default
    elsewhere (so the bit-exact test covers both tilings)."""
    for key, tile in (("1x1-wide-blocking", (5, 4)), ("1x1-stride2-wide-blocking", (4, 4))):
        n, c, h, w_, o, k, s, pad, d, _, _ = CONVS[key]
        shape = ConvShape(n, c, h, w_, o, (k, k), (s, s), pad, (d, d))
        assert register_tile(shape, VNNI) == tile
        assert register_tile(shape, AVX2)[1] == AVX2.channel_blocks(o)


def test_avx2_3x3_row_needs_a_blocked_output():
    """The AVX2 3x3 row (1 lane block) covers convs storing the blocked layout with 7
    output columns or more (test_cpu_blocked's 3x3 chain runs it bit-exact); NCHW outputs,
    narrower ones and VNNI keep the default 2 blocks (the bit-exact tests above)."""
    for key, tile in (("3x3", (5, 1)), ("asym-pad-dilated", (6, 1)), ("3x3-stride2", (6, 2))):
        n, c, h, w_, o, k, s, pad, d, _, _ = CONVS[key]
        shape = ConvShape(n, c, h, w_, o, (k, k), (s, s), pad, (d, d))
        assert register_tile(shape, AVX2, blocked_out=True) == tile
        assert register_tile(shape, AVX2)[1] == AVX2.channel_blocks(o)
        assert register_tile(shape, VNNI, blocked_out=True)[1] == VNNI.channel_blocks(o)


def test_conv_blocking_rejects_too_many_registers():
    with pytest.raises(ValueError, match="exceed 32 registers"):
        ConvBlocking("vnni", (1, 1), min_width=14, max_tile=8, out_blocks=4, max_group_bytes=1)


@pytest.mark.parametrize("case", CONVS.values(), ids=CONVS.keys())
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_conv2d_kernel_bit_exact(isa, mcpu, case):
    n, c, h, w_, o, k, s, pad, d, dtype, zx = case
    rng = np.random.default_rng(0)
    x, w = _data(rng, (n, c, h, w_), dtype), _data(rng, (o, c, k, k), "int8")
    shape = ConvShape(n, c, h, w_, o, (k, k), (s, s), pad, (d, d))
    z = zx + isa.shift(dtype, zx)
    args = [
        x,
        packing.pack_conv_weight(
            w, isa.lanes, isa.k, shape.ic_block(isa), isa.weight_dtype, isa.padded_channels(o)
        ),
    ]
    if z:
        args.append(packing.compensation(w, z, isa.padded_channels(o)))
    got = _run(conv2d_kernel(shape, isa, dtype, zx), mcpu, args, (n, o, *shape.out_hw))
    np.testing.assert_array_equal(got, conv_reference(x, w, zx, (s, s), pad, (d, d)))


@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "zx"),
    # 64 rows: AVX2 pads them to 66 (6-row tiles, Isa.row_slack), VNNI runs 8 tiles of 8
    [
        (7, 33, 20, "int8", -5),
        (1, 64, 16, "uint8", 128),
        (20, 9, 3, "int8", 0),
        (64, 40, 24, "int8", 3),
    ],
)
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_dense_kernel_bit_exact(isa, mcpu, m, k, n, dtype, zx):
    rng = np.random.default_rng(1)
    x, w = _data(rng, (m, k), dtype), _data(rng, (n, k), "int8")
    z = zx + isa.shift(dtype, zx)
    args = [
        x,
        packing.pack_dense_weight(w, isa.lanes, isa.k, isa.weight_dtype, isa.padded_channels(n)),
    ]
    if z:
        args.append(packing.compensation(w, z, isa.padded_channels(n)))
    got = _run(dense_kernel(m, k, n, isa, dtype, zx), mcpu, args, (m, n))
    np.testing.assert_array_equal(got, (x.astype(np.int64) - zx) @ w.T.astype(np.int64))


@pytest.mark.parametrize(
    ("c", "h", "k", "s", "pad", "dtype", "zx"),
    [
        (8, 9, 3, 1, 1, "int8", -128),
        (5, 11, 5, 2, 2, "uint8", 140),
        (3, 6, 3, 1, 0, "int8", 4),
        (4, 40, 3, 1, 1, "int8", 7),  # wide 3x3: the row kernel
        (17, 70, 3, 2, 1, "uint8", 120),
        (40, 12, 3, 2, 1, "int8", -9),  # 3 channel blocks (VNNI) x 2 batches: planes packed apart
        (33, 9, 5, 1, 2, "uint8", 3),
        # blocked kernel: padding is the zero point's code, subtracted as code x sum(w);
        # 255 and (int8 -128 ->) 0 are the extreme codes
        (6, 10, 5, 1, 2, "uint8", 255),
    ],
)
@pytest.mark.parametrize("mcpu", [HOST, "haswell"])
def test_depthwise_kernel_bit_exact(mcpu, c, h, k, s, pad, dtype, zx):
    rng = np.random.default_rng(2)
    x, w = _data(rng, (2, c, h, h + 1), dtype), _data(rng, (c, 1, k, k), "int8")
    shape = ConvShape(2, c, h, h + 1, c, (k, k), (s, s), (pad,) * 4)
    lanes = 16 if mcpu == HOST else 8
    assert blocked(shape) == (h < 40)
    args = [x, depthwise_weight(shape, w, lanes)]
    got = _run(depthwise_kernel(shape, dtype, zx, lanes), mcpu, args, (2, c, *shape.out_hw))
    ref = np.concatenate(
        [
            conv_reference(x[:, i : i + 1], w[i : i + 1], zx, (s, s), (pad,) * 4, (1, 1))
            for i in range(c)
        ],
        axis=1,
    )
    np.testing.assert_array_equal(got, ref)


def test_extreme_values_do_not_saturate():
    """All-extreme operands: the largest sums a u8 x s8 kernel can see (vpmaddubsw would
    saturate its int16 pair sums here; vpmaddwd and vpdpbusd must not)."""
    x = np.full((1, 64, 4, 4), -128, np.int8)
    w = np.full((16, 64, 3, 3), -128, np.int8)
    for isa, mcpu in [(VNNI, HOST), (AVX2, "haswell")]:
        if isa.feature == "avx512vnni" and "avx512_vnni" not in FLAGS:
            continue
        shape = ConvShape(1, 64, 4, 4, 16, (3, 3), (1, 1), (1, 1, 1, 1))
        zx = 127
        z = zx + isa.shift("int8", zx)
        args = [
            x,
            packing.pack_conv_weight(
                w, isa.lanes, isa.k, shape.ic_block(isa), isa.weight_dtype, isa.padded_channels(16)
            ),
        ]
        if z:
            args.append(packing.compensation(w, z, isa.padded_channels(16)))
        got = _run(conv2d_kernel(shape, isa, "int8", zx), mcpu, args, (1, 16, 4, 4))
        ref = conv_reference(x, w, zx, (1, 1), (1, 1, 1, 1), (1, 1))
        np.testing.assert_array_equal(got, ref)


def test_isa_from_target():
    assert isa_of(_target("znver4")) is VNNI
    assert isa_of(_target("znver3")) is AVX2
    assert isa_of(_target("haswell")) is AVX2
    assert isa_of(tvm.target.Target({"kind": "llvm"})) is None  # generic x86-64


@functools.cache
def _quantized(make):
    mod, params, data = make()
    return autoq.quantize(mod, params, data(8, 1), Config(recipe="cnn")), data


@pytest.mark.parametrize("make", [small_cnn, mlp, attention])
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_realized_model_same_outputs_with_kernels(isa, mcpu, make):
    qmod, data = _quantized(make)
    target = _target(mcpu)
    lowered = lower_to_cpu_kernels(qmod, target)
    kernels = [gv.name_hint for gv in lowered.functions if gv.name_hint.startswith("autoq_")]
    dense_or_conv = [name for name in kernels if name.split("_")[1] in ("conv2d", "dense")]
    assert dense_or_conv and all(name.split("_")[2].startswith(isa.name) for name in dense_or_conv)
    assert (make is small_cnn) == any("depthwise" in name for name in kernels)
    outs = []
    for use in (True, False):
        vm = relax.VirtualMachine(autoq.compile(qmod, target, cpu_kernels=use), tvm.cpu())
        outs.append([vm["main"](tvm.runtime.tensor(x)).numpy() for x in data(3, 5)])
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


def _conv_transpose_module(x_shape, w, strides, padding=(0, 0)):
    """main(x) = relu(conv2d_transpose(x, const w) + bias), float32 NCHW / IOHW."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    bias = np.linspace(-1, 1, w.shape[1], dtype=np.float32).reshape(1, -1, 1, 1)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = relax.op.nn.conv2d_transpose(x, relax.const(w), strides=strides, padding=padding)
            out = bb.emit_output(relax.op.nn.relu(relax.op.add(bb.emit(y), relax.const(bias))))
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


def conv_transpose_reference(x, w, strides):
    """float64 conv2d_transpose with kernel == stride: every output pixel reads one input."""
    sh, sw = strides
    out = np.einsum("nchw,cors->nohrws", x.astype(np.float64), w.astype(np.float64))
    n, o, h, _, wd, _ = out.shape
    return out.reshape(n, o, h * sh, wd * sw)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "strides", "padding", "kernel"),
    [
        ((1, 6, 5, 7), (6, 3, 2, 2), (2, 2), (0, 0), True),
        ((2, 3, 4, 3), (3, 5, 3, 1), (3, 1), (0, 0), True),
        ((1, 16, 3, 48), (16, 8, 2, 2), (2, 2), (0, 0), True),  # 8 channels x 3 vectors
        ((1, 4, 5, 5), (4, 2, 3, 3), (2, 2), (1, 1), False),  # overlapping taps: generic
    ],
)
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_conv2d_transpose_kernel_same_as_generic(
    isa, mcpu, x_shape, w_shape, strides, padding, kernel
):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    mod = _conv_transpose_module(x_shape, w, strides, padding)
    target = _target(mcpu)
    lowered = lower_to_cpu_kernels(mod, target)
    names = [gv.name_hint for gv in lowered.functions]
    assert ("autoq_conv2d_transpose" in names) == kernel
    outs = [
        relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=use), tvm.cpu())["main"](
            tvm.runtime.tensor(x)
        ).numpy()
        for use in (True, False)
    ]
    np.testing.assert_array_equal(outs[0], outs[1])
    if kernel:
        bias = np.linspace(-1, 1, w_shape[1]).reshape(1, -1, 1, 1)
        ref = np.maximum(conv_transpose_reference(x, w, strides) + bias, 0)
        np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=1e-5)


VBMI = pytest.mark.skipif("avx512vbmi" not in FLAGS, reason="this CPU has no AVX-512 VBMI")


@pytest.mark.parametrize(
    ("kernel", "table_dtype"),
    [
        (lut_kernel, "int8"),
        pytest.param(vbmi_lut_kernel, "int8", marks=VBMI),
        pytest.param(vbmi_lut_kernel, "uint8", marks=VBMI),
    ],
)
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_lut_kernel_matches_numpy(dtype, kernel, table_dtype):
    rng = np.random.default_rng(5)
    x = _data(rng, (2, 3, 70, 50 + 3), dtype)  # 64-byte vectors and a scalar tail
    x.reshape(-1)[:256] = np.arange(256).astype(np.uint8).view(dtype)  # every index
    lo, hi = (-128, 128) if table_dtype == "int8" else (0, 256)
    table = rng.integers(lo, hi, 256).astype(table_dtype)
    lib = tvm.compile(tvm.IRModule({"main": kernel(x.shape, dtype, table_dtype)}), _target(HOST))
    got = tvm.runtime.tensor(np.zeros(x.shape, table_dtype))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(table), got)
    qmin = -128 if dtype == "int8" else 0
    np.testing.assert_array_equal(got.numpy(), table[x.astype(np.int32) - qmin])


@pytest.mark.parametrize(("mcpu", "vbmi"), [("icelake-server", True), ("znver3", False)])
def test_lut_lowering_uses_vbmi_where_the_target_has_it(mcpu, vbmi):
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        table = relax.const(np.arange(256).astype(np.uint8).view(np.int8))
        out = bb.emit(lut(x, table))
        bb.emit_func_output(out)
    mod = lower_to_cpu_kernels(bb.get(), _target(mcpu))
    text = mod.script()
    assert ("vpermi2var" in text) == vbmi
    assert "autoq_lut" in text


def test_fused_upsampling_read_is_unrolled_and_exact():
    """A fused elementwise function reading ``a[..., j // 2]`` (nearest upsampling x2) gets
    its innermost loop split by 2 and unrolled; same values as numpy."""
    from tvm import te

    a = te.placeholder((64, 40), "int8", name="a")
    b = te.placeholder((64, 80), "int8", name="b")
    out = te.compute((64, 80), lambda i, j: a[i, j // 2].astype("int32") + b[i, j], name="up")
    func = schedule_fused(te.create_prim_func([a, b, out]))
    assert "T.unroll(2)" in func.script()
    lib = tvm.compile(tvm.IRModule({"main": func}), _target(HOST))
    rng = np.random.default_rng(4)
    xa, xb = _data(rng, (64, 40), "int8"), _data(rng, (64, 80), "int8")
    got = tvm.runtime.tensor(np.zeros((64, 80), np.int32))
    lib["main"](tvm.runtime.tensor(xa), tvm.runtime.tensor(xb), got)
    ref = np.repeat(xa.astype(np.int32), 2, axis=1) + xb
    np.testing.assert_array_equal(got.numpy(), ref)


@pytest.mark.parametrize("limit, blocks", [(None, ["dequantize"]), (20, ["qnn_add", "dequantize"])])
def test_large_blocks_are_not_inlined_into_each_other(limit, blocks, monkeypatch):
    """Two half-even qnn.adds in a row, then a dequantize (MiniLM's embedding sum). Blocks with
    more than MAX_INLINE_INT64_NODES int64 nodes are not inlined into a consumer with more
    (the general fixed-point requantize, 80-170 nodes each, inlined into one: the TIR
    simplifier took seconds). With a constant shift each add is ~30 nodes, so at the
    default limit the chain inlines into the dequantize; at a limit of 20 the adds are
    "large": they stay two loop nests (the second inlined into the small dequantize).
    Same values as without autoq's kernels and schedules either way."""
    from autoq.cpu import injective
    from autoq.cpu.injective import ScheduleFused
    from autoq.ir.cpu_pipeline import fused

    if limit is not None:
        monkeypatch.setattr(injective, "MAX_INLINE_INT64_NODES", limit)
    shape = (64, 96)
    names = ("a", "b", "c")
    xs = [relax.Var(n, relax.TensorType(shape, "int8")) for n in names]
    f32 = lambda v: relax.const(np.float32(v))  # noqa: E731
    i32 = lambda v: relax.const(np.int32(v))  # noqa: E731
    bb = relax.BlockBuilder()
    with bb.function("main", xs):
        with bb.dataflow():
            q = (f32(0.02), i32(3), f32(0.03), i32(-5), f32(0.04), i32(1))
            ab = bb.emit(qnn.add(xs[0], xs[1], *q, rounding="half_even"))
            q = (f32(0.04), i32(1), f32(0.01), i32(2), f32(0.05), i32(-2))
            abc = bb.emit(qnn.add(ab, xs[2], *q, rounding="half_even"))
            out = bb.emit_output(bb.emit(qnn.dequantize(abc, f32(0.05), i32(-2))))
        bb.emit_func_output(out)
    mod, target = bb.get(), _target(HOST)
    with target:
        scheduled = ScheduleFused()(fused(mod, target))
    (func,) = [f for gv, f in scheduled.functions_items() if "qnn_add" in gv.name_hint]
    sch = tvm.s_tir.Schedule(func)
    assert [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))] == blocks
    rng = np.random.default_rng(5)
    args = [tvm.runtime.tensor(_data(rng, shape, "int8")) for _ in names]
    outs = []
    for kernels in (True, False):
        ex = autoq.compile(mod, target, cpu_kernels=kernels)
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](*args).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


def test_doctests():
    for module in (packing, tiling, isa_mod, lut_mod, depthwise, injective):
        assert doctest.testmod(module).failed == 0


def _sum_func(dtype: str, keepdims: bool = False):
    """main(x) = sum(int32(x) - 5) over the last two axes (or float32), a fused pooling."""
    from tvm import te

    x = te.placeholder((2, 24, 10, 40), "int8", name="x")
    acc = "int32" if dtype == "int32" else "float32"
    sub = te.compute(x.shape, lambda *i: x[i].astype(acc) - tvm.tirx.const(5, acc), name="sub")
    k2, k3 = te.reduce_axis((0, 10), "k2"), te.reduce_axis((0, 40), "k3")
    if keepdims:
        out = te.compute(
            (2, 24, 1, 1),
            lambda n, c, i, j: te.sum(sub[n, c, k2, k3], axis=[k2, k3]),
            name="s",
        )
    else:
        out = te.compute((2, 24), lambda n, c: te.sum(sub[n, c, k2, k3], axis=[k2, k3]), name="s")
    return te.create_prim_func([x, out])


@pytest.mark.parametrize("keepdims", [False, True])
def test_integer_sum_is_vectorized_and_exact(keepdims):
    from autoq.cpu.int_sum import schedule_integer_sum

    func = schedule_fused(_sum_func("int32", keepdims))
    text = func.script()
    assert "_rf" in text and "T.vectorized" in text and "T.parallel" in text
    x = np.random.default_rng(6).integers(-128, 128, (2, 24, 10, 40)).astype(np.int8)
    lib = tvm.compile(tvm.IRModule({"main": func}), _target(HOST))
    want = (x.astype(np.int64) - 5).sum(axis=(2, 3), keepdims=keepdims)
    got = tvm.runtime.tensor(np.zeros(want.shape, np.int32))
    lib["main"](tvm.runtime.tensor(x), got)
    np.testing.assert_array_equal(got.numpy(), want)
    assert schedule_integer_sum(_sum_func("float32")) is None  # float sums keep their order
    from tvm import te

    a = te.placeholder((8, 16), "int32", name="a")
    b = te.placeholder((16, 8), "int32", name="b")
    k = te.reduce_axis((0, 16), "k")
    mm = te.compute((8, 8), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="mm")
    assert schedule_integer_sum(te.create_prim_func([a, b, mm])) is None  # operands reused
