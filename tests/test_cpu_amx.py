"""autoq.cpu AMX path: the tile dense, conv and batch matmul kernels against numpy int64 (where the CPU has AMX and
Linux grants the tile state; skipped with the reason otherwise), its selection from the
target's features, the default target's AMX ``mattr``, the permission error, and a realized
attention model compiled for an AMX target against the generic lowering, bit for bit."""

from __future__ import annotations

import doctest
import functools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config, qnn
from autoq import primitives as P
from autoq.cpu import amx, amx_batch_matmul, amx_conv2d, amx_dense, amx_tiles
from autoq.cpu.amx_batch_matmul import amx_batch_matmul_applies, amx_batch_matmul_kernel
from autoq.cpu.amx_conv2d import (
    amx_conv2d_kernel,
    amx_conv_applies,
    amx_conv_compensation,
    amx_conv_weight,
)
from autoq.cpu.amx_dense import amx_dense_kernel
from autoq.cpu.batch_matmul import matmul_zero_points
from autoq.cpu.conv2d import ConvShape
from autoq.cpu.epilogue import Epilogue
from autoq.cpu.isa import VNNI, kernel_isa
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.packing import compensation, pack_dense_weight, round_up
from autoq.errors import PlatformError
from models import attention

HOST = tvm.target.codegen.llvm_get_system_cpu()
FLAGS = amx.cpu_flags(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
_REASON = (
    "this CPU has no AMX int8 tiles (amx_tile/amx_int8 in /proc/cpuinfo)"
    if not {"amx_tile", "amx_int8"} <= FLAGS
    else f"Linux refuses the AMX tile state: {amx.request_amx()}"
)
needs_amx = pytest.mark.skipif(
    not {"amx_tile", "amx_int8"} <= FLAGS or amx.request_amx() is not None, reason=_REASON
)
AMX_TARGET = tvm.target.Target({"kind": "llvm", "mcpu": HOST, "mattr": ["+amx-tile", "+amx-int8"]})
HOST_TARGET = tvm.target.Target({"kind": "llvm", "mcpu": HOST})


def test_doctests():
    for module in (amx, amx_batch_matmul, amx_conv2d, amx_dense, amx_tiles):
        assert doctest.testmod(module).failed == 0


def _dense(x: np.ndarray, w: np.ndarray, zx: int) -> np.ndarray:
    m, k = x.shape
    n = w.shape[0]
    shift = VNNI.shift(str(x.dtype), zx)
    np_ = round_up(n, amx_tiles.BLOCK)
    lib = tvm.compile(
        tvm.IRModule({"main": amx_dense_kernel(m, k, n, str(x.dtype), shift)}), AMX_TARGET
    )
    args = [
        x,
        pack_dense_weight(w, 16, 4, "int8", np_, round_up(k, amx_tiles.KSTEP)),
        compensation(w, zx + shift, np_),
    ]
    out = tvm.runtime.tensor(np.zeros((m, n), np.int32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


@needs_amx
@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "zx"),
    [
        (32, 64, 32, "int8", 0),  # one block, one step
        (128, 384, 96, "int8", -5),  # several blocks, tasks split over channel groups
        (37, 70, 19, "int8", 3),  # every dimension padded
        (40, 130, 50, "int8", 7),  # a complete block (stored in place) next to partial ones
        (9, 200, 50, "uint8", 128),  # uint8 activations: no shift, zx * sum(w) compensation
    ],
)
def test_amx_dense_matches_numpy(m, k, n, dtype, zx):
    rng = np.random.default_rng(m + k + n)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (m, k)).astype(dtype)
    w = rng.integers(-128, 128, (n, k)).astype(np.int8)
    ref = (x.astype(np.int64) - zx) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_dense(x, w, zx), ref)


@needs_amx
def test_amx_dense_extreme_values():
    """All-extreme operands, K = 1536: the largest int32 sums (nothing saturates in tdpbusd)."""
    x = np.full((16, 1536), -128, np.int8)
    w = np.full((32, 1536), -128, np.int8)
    ref = (x.astype(np.int64) - 127) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_dense(x, w, 127), ref)


def _batch_matmul(a, b, za, zb, epilogue=None):
    """The AMX batch matmul kernel's output on ``a [batch, m, k]``, ``b [batch, k, n]``."""
    batch, m, k = a.shape
    n = b.shape[2]
    func = amx_batch_matmul_kernel(batch, m, k, n, str(a.dtype), epilogue, (za, zb))
    lib = tvm.compile(tvm.IRModule({"main": func}), AMX_TARGET)
    out_dtype = "int32" if epilogue is None else epilogue.out_dtype
    out = tvm.runtime.tensor(np.zeros((batch, m, n), out_dtype))
    args = [a, b, matmul_zero_points(za, zb)] + ([] if epilogue is None else [epilogue.table()])
    lib["main"](*[tvm.runtime.tensor(v) for v in args], out)
    return out.numpy()


@needs_amx
@pytest.mark.parametrize(
    ("batch", "m", "k", "n", "dtype"),
    [
        (12, 128, 32, 128, "int8"),  # MiniLM's q @ k^T: K < 64, narrowed tiles, 4 tasks of 3
        (12, 128, 128, 32, "int8"),  # MiniLM's p @ v: two 64-deep steps
        (3, 32, 4, 32, "int8"),  # the narrowest tile (4 bytes, one row of ones), 3 tasks
        (2, 64, 192, 96, "uint8"),  # uint8 rows (tdpbusd), three steps, three column blocks
        (5, 32, 64, 64, "uint8"),  # an odd batch: 5 tasks of one head
    ],
)
def test_amx_batch_matmul_matches_numpy(batch, m, k, n, dtype):
    """``(a - za) @ (b - zb)`` for run-time zero points, extremes included, with an all-max
    row of ``a`` and an all-min column of ``b`` (the largest row and column sums)."""
    assert amx_batch_matmul_applies(m, k, n)
    rng = np.random.default_rng(m + k + n)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max + 1, (batch, m, k)).astype(dtype)
    b = rng.integers(-128, 128, (batch, k, n)).astype(np.int8)
    a[-1, 3, :] = info.max
    b[-1, :, 5] = -128
    for za, zb in ((0, 0), (3, -7), (int(info.min), 127), (int(info.max), -128)):
        want = (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)
        np.testing.assert_array_equal(_batch_matmul(a, b, za, zb), want)


@needs_amx
@pytest.mark.parametrize("rounding", ["half_even", "float"])
def test_amx_batch_matmul_requantize_epilogue(rounding):
    """Attention's scores requantized in the kernel (the float path by reciprocal, as the
    lowering runs it; half-even in float64, the zero points being known) == numpy's
    requantize of the exact product."""
    rng = np.random.default_rng(7)
    batch, m, k, n, za, zb = 2, 64, 32, 64, -4, 11
    a = rng.integers(-128, 128, (batch, m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (batch, k, n)).astype(np.int8)
    s_in, s_out, z_out = np.float32(0.0121), np.float32(3.3), -9
    params = (s_in, 0, s_out, z_out)
    if rounding != "float":
        mult, shift = P.quantize_multiplier(np.float64(s_in) / np.float64(s_out))
        params = (*params, int(mult), int(shift))
    epi = Epilogue(None, params, rounding, "int8", n, reciprocal=rounding == "float")
    acc = ((a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)).astype(np.int32)
    want = P.requantize(acc, s_in, 0, s_out, z_out, "int8", rounding)
    assert len(np.unique(want)) > 20, "the case must span many output codes"
    np.testing.assert_array_equal(_batch_matmul(a, b, za, zb, epi), want)


def test_amx_batch_matmul_shapes():
    """Rows and columns in whole 32-blocks, K a multiple of 4 up to 64 or of 64; others are
    refused by name (the lowering keeps them on VNNI)."""
    assert amx_batch_matmul_applies(32, 64, 32) and amx_batch_matmul_applies(64, 256, 32)
    for m, k, n in ((20, 32, 32), (32, 32, 40), (32, 30, 32), (32, 96, 32)):
        assert not amx_batch_matmul_applies(m, k, n)
    with pytest.raises(ValueError, match="20 x 32 x 32"):
        amx_batch_matmul_kernel(1, 20, 32, 32, "int8")


def test_kernel_isa_from_target_features():
    assert kernel_isa(AMX_TARGET).amx
    assert kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})).amx
    assert not kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})).amx
    assert not kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})).amx
    # float epilogues divide by reciprocal (same quotients) on AMX targets only
    assert kernel_isa(AMX_TARGET).reciprocal
    assert not kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})).reciprocal


def test_amx_epilogues_divide_by_reciprocal():
    """A conv's float requantize lowered for an AMX target takes the reciprocal row (its
    kernel multiplies and corrects with FMAs); for a VNNI-only target it divides."""
    w = np.random.default_rng(0).integers(-128, 128, (32, 64, 3, 3)).astype(np.int8)
    conv = _qnn_conv((1, 64, 6, 6), w)["main"]
    bb = relax.BlockBuilder()
    with bb.function("main", conv.params):
        with bb.dataflow():
            acc = bb.emit(conv.body.blocks[0].bindings[-1].value)
            scales = [relax.const(np.full(32, 2e-4, np.float32)), relax.const(np.int32(0))]
            out = [relax.const(np.float32(0.05)), relax.const(np.int32(-3))]
            gv = bb.emit_output(qnn.requantize(acc, *scales, *out, axis=1))
        bb.emit_func_output(gv)
    mod = tvm.IRModule({"main": bb.get()["main"]})
    znver4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    for target, reciprocal in ((AMX_TARGET, True), (znver4, False)):
        fns = lower_to_cpu_kernels(mod, target).functions_items()
        kernels = [f for gv, f in fns if gv.name_hint.startswith("autoq_conv2d")]
        assert len(kernels) == 1
        script = kernels[0].script(show_meta=False)
        # both round the dequantize product with one fma (tensor_exprs.product); only the
        # reciprocal path adds the correction fmas, and only the other one divides
        assert (" / " in script) == (not reciprocal)
        assert (script.count("fma(") > 1) == reciprocal


def test_default_target_keeps_host_cpu_and_adds_amx_when_usable():
    target = autoq.default_target()
    assert str(target.attrs["mcpu"]) == HOST
    usable = {"amx_tile", "amx_int8"} <= FLAGS and amx.request_amx() is None
    assert amx.target_has_amx(target) == usable
    attrs = [str(a) for a in target.attrs.get("mattr", [])]
    assert attrs == amx.missing_amx_features(HOST, FLAGS if usable else frozenset())


def test_refused_tile_state_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(amx, "request_amx", lambda: "arch_prctl(...) failed: nope (errno 22)")
    with pytest.raises(PlatformError, match=r"uses AMX tiles.*errno 22.*drop them from 'mattr'"):
        amx.require_amx(AMX_TARGET)
    amx.require_amx(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))  # no AMX: fine


def test_dense_rows_choose_amx_or_vnni():
    """Lowering for an AMX target: dense with >= AMX_MIN_ROWS rows on tiles, fewer on VNNI;
    targets without the AMX features keep VNNI (nothing is run: works on any CPU)."""
    many, few = _quantized(8)[0], _quantized(4)[0]
    assert _lowered_names(many, AMX_TARGET) == {"autoq_dense_amx"}
    sapphire = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})
    assert _lowered_names(many, sapphire) == {"autoq_dense_amx"}
    znver4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    assert _lowered_names(many, znver4) == {"autoq_dense_vnni"}
    assert _lowered_names(few, AMX_TARGET) == {"autoq_dense_vnni"}


def _lowered_names(qmod, target, prefix="autoq_dense"):
    lowered = lower_to_cpu_kernels(qmod, target)
    names = (gv.name_hint for gv in lowered.functions)
    return {n.rstrip("0123456789") for n in names if n.startswith(prefix)}


@functools.cache
def _quantized(seq: int, dim: int = 40):
    mod, params, data = attention(seq=seq, dim=dim)
    return autoq.quantize(mod, params, data(8, 1), Config(recipe="cnn")), data


@needs_amx
@pytest.mark.parametrize(
    ("seq", "dim", "matmuls"),
    [
        (20, 40, "autoq_batch_matmul_vnni"),  # 20 rows: no whole 32-blocks
        (32, 32, "autoq_batch_matmul_amx"),  # q @ k^T and p @ v on tiles
    ],
)
def test_realized_attention_same_outputs_on_amx(seq, dim, matmuls):
    qmod, data = _quantized(seq, dim)
    assert _lowered_names(qmod, AMX_TARGET) == {"autoq_dense_amx"}
    assert _lowered_names(qmod, AMX_TARGET, "autoq_batch_matmul") == {matmuls}
    outs = []
    for target, use in (
        (AMX_TARGET, True),
        (tvm.target.Target({"kind": "llvm", "mcpu": HOST}), False),
    ):
        vm = relax.VirtualMachine(autoq.compile(qmod, target, cpu_kernels=use), tvm.cpu())
        outs.append([vm["main"](tvm.runtime.tensor(x)).numpy() for x in data(3, 5)])
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


def _conv_reference(x, w, zx, padding):
    """int64 conv2d(x - zx, w), stride 1, NCHW / OIHW, padding (top, left, bottom, right)."""
    pt, pl, pb, pr = padding
    xc = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    kh, kw = w.shape[2:]
    oh, ow = xc.shape[2] - kh + 1, xc.shape[3] - kw + 1
    out = np.zeros((x.shape[0], w.shape[0], oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nchw,oc->nohw", xc[:, :, i : i + oh, j : j + ow], w[:, :, i, j])
    return out


@needs_amx
@pytest.mark.parametrize(
    ("n", "c", "hw", "oc", "kernel", "padding", "dtype", "zx", "stride"),
    [
        (1, 64, (14, 14), 96, (3, 3), (1, 1, 1, 1), "int8", -3, 1),  # padded: via the stack
        (2, 70, (7, 9), 40, (1, 1), (0, 0, 0, 0), "int8", 5, 1),  # 1x1: direct stores + tails
        (1, 64, (6, 11), 33, (5, 3), (2, 0, 1, 1), "uint8", 131, 1),  # asymmetric pad, uint8
        (1, 128, (8, 8), 64, (1, 1), (0, 0, 0, 0), "int8", 0, 1),  # every block direct
        (1, 64, (9, 10), 40, (1, 1), (0, 0, 0, 0), "int8", 2, 2),  # strided 1x1: subsampled
        (1, 16, (12, 12), 64, (1, 1), (0, 0, 0, 0), "int8", -1, 1),  # 16 channels: padded to 64
        # 24 output channels: the lower tiles narrowed to 8 rows; 96 inputs: quads 24-31 of
        # the packed image keep the pad; padded width 12: spans of 1-12 pixels copied out
        (1, 96, (9, 10), 24, (3, 3), (1, 1, 1, 1), "int8", 7, 1),
        (1, 64, (5, 7), 5, (3, 3), (1, 1, 1, 1), "uint8", 255, 1),  # 5 channels: 1-row tiles
        (1, 32, (9, 10), 32, (3, 3), (1, 1, 1, 1), "int8", -5, 1),  # 32 channels: 2 taps a row
        # two images: each image's copy rows shifted from its own packed rows; 24 outputs
        (2, 32, (5, 6), 24, (3, 3), (1, 1, 1, 1), "int8", 9, 1),
        # 16 channels, 4 taps a row: copies 2, 3 start left of the packed image (1 pixel of
        # left padding, none on top), the last row tap of each kernel row past the width
        (1, 16, (7, 8), 40, (3, 4), (0, 1, 1, 2), "uint8", 7, 1),
    ],
)
def test_amx_conv2d_matches_numpy(n, c, hw, oc, kernel, padding, dtype, zx, stride):
    shape = ConvShape(n, c, *hw, oc, kernel, (stride, stride), padding)
    assert amx_conv_applies(shape)
    rng = np.random.default_rng(c + oc)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (n, c, *hw)).astype(dtype)
    w = rng.integers(-128, 128, (oc, c, *kernel)).astype(np.int8)
    shift = VNNI.shift(dtype, zx)
    func = amx_conv2d_kernel(shape, dtype, shift, zx + shift)
    lib = tvm.compile(tvm.IRModule({"main": func}), AMX_TARGET)
    args = [x, amx_conv_weight(w), amx_conv_compensation(w, zx + shift)]
    out = tvm.runtime.tensor(np.zeros((n, oc, *shape.out_hw), np.int32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    ref = _conv_reference(x[:, :, ::stride, ::stride], w, zx, padding)
    np.testing.assert_array_equal(out.numpy(), ref)


def _qnn_conv(x_shape, w, strides=(1, 1), padding=(1, 1, 1, 1)):
    """main(x: int8) = qnn.conv2d(x, const w) (int32), per-channel weight scales, zp -7."""
    from autoq import qnn

    x = relax.Var("x", relax.TensorType(x_shape, "int8"))
    bb = relax.BlockBuilder()
    oc = w.shape[0]
    with bb.function("main", [x]):
        with bb.dataflow():
            scale_w = relax.const(np.full(oc, 0.01, np.float32))
            call = qnn.conv2d(
                x, relax.const(w), relax.const(np.float32(0.02)), relax.const(np.int32(-7)),
                scale_w, relax.const(np.zeros(oc, np.int32)), strides=strides, padding=padding,
            )  # fmt: skip
            out = bb.emit_output(call)
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


def test_conv_lowering_chooses_amx_for_stride_one():
    w = np.random.default_rng(0).integers(-128, 128, (32, 64, 3, 3)).astype(np.int8)

    def names(mod, target):
        fns = lower_to_cpu_kernels(mod, target).functions
        return {gv.name_hint for gv in fns if gv.name_hint.startswith("autoq_conv2d")}

    assert names(_qnn_conv((1, 64, 6, 6), w), AMX_TARGET) == {"autoq_conv2d_amx"}
    assert names(_qnn_conv((1, 64, 6, 6), w, strides=(2, 2)), AMX_TARGET) == {"autoq_conv2d_vnni"}
    pointwise = _qnn_conv((1, 64, 6, 6), w[..., :1, :1], strides=(2, 2), padding=(0, 0, 0, 0))
    assert names(pointwise, AMX_TARGET) == {"autoq_conv2d_amx"}
    folded = _qnn_conv((1, 32, 6, 6), w[:, :32])  # 2 taps fill a 64-byte row
    assert names(folded, AMX_TARGET) == {"autoq_conv2d_amx"}
    narrow = _qnn_conv((1, 40, 6, 6), w[:, :40])
    assert names(narrow, AMX_TARGET) == {"autoq_conv2d_vnni"}
    narrow_1x1 = _qnn_conv((1, 32, 6, 6), w[:, :32, :1, :1], padding=(0, 0, 0, 0))
    assert names(narrow_1x1, AMX_TARGET) == {"autoq_conv2d_amx"}
    few_out = _qnn_conv((1, 32, 6, 6), w[:16, :32, :1, :1], padding=(0, 0, 0, 0))
    assert names(few_out, AMX_TARGET) == {"autoq_conv2d_vnni"}
    znver4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    assert names(_qnn_conv((1, 64, 6, 6), w), znver4) == {"autoq_conv2d_vnni"}


@needs_amx
def test_qnn_conv_on_amx_same_as_generic_lowering():
    rng = np.random.default_rng(1)
    w = rng.integers(-128, 128, (48, 64, 3, 3)).astype(np.int8)
    mod = _qnn_conv((1, 64, 10, 12), w)
    x = tvm.runtime.tensor(rng.integers(-128, 128, (1, 64, 10, 12)).astype(np.int8))
    outs = [
        relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=use), tvm.cpu())["main"](x)
        for target, use in ((AMX_TARGET, True), (HOST_TARGET, False))
    ]
    np.testing.assert_array_equal(outs[0].numpy(), outs[1].numpy())


def test_amx_conv_rule_keeps_large_pointwise_convs_with_few_channels_on_vnni():
    def pointwise(c, hw, oc):
        return ConvShape(1, c, hw, hw, oc, (1, 1), (1, 1), (0, 0, 0, 0))

    assert amx_conv_applies(pointwise(16, 60, 64))
    assert not amx_conv_applies(pointwise(16, 240, 64))  # memory-bound: VNNI measured faster
    assert not amx_conv_applies(pointwise(32, 120, 64))
    assert amx_conv_applies(pointwise(64, 240, 64))  # >= 64 channels: no padding


def test_amx_conv_rule_folds_taps_only_when_they_fill_the_rows():
    def conv3x3(c):
        return ConvShape(1, c, 56, 56, 32, (3, 3), (1, 1), (1, 1, 1, 1))

    assert amx_conv_applies(conv3x3(32))  # 2 x 32 channels: whole 64-byte rows
    assert not amx_conv_applies(conv3x3(16))  # 3 x 16: a quarter padding, not measured
    assert not amx_conv_applies(conv3x3(40))  # no room for a second tap: half padding
    assert not amx_conv_applies(replace(conv3x3(32), strides=(2, 2)))
