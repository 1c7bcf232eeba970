"""The AMX conv of strided convs with few input channels (autoq.cpu.amx_strided_conv2d):
bit-exact against numpy, and what the CPU lowering dispatches to it."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from numpy.lib.stride_tricks import sliding_window_view
from test_cpu_amx import AMX_TARGET, HOST_TARGET, needs_amx
from tvm import relax

import autoq
from autoq import qnn
from autoq.cpu import amx_strided_conv2d
from autoq.cpu.amx_conv2d import amx_conv_compensation
from autoq.cpu.amx_strided_conv2d import (
    amx_strided_conv2d_kernel,
    amx_strided_conv_applies,
    strided_conv_weight,
)
from autoq.cpu.conv2d import ConvShape
from autoq.cpu.isa import VNNI
from autoq.cpu.lowering import lower_to_cpu_kernels


def test_doctests():
    assert doctest.testmod(amx_strided_conv2d).failed == 0


def _reference(x, w, zx, strides, padding):
    """int64 conv2d(x - zx, w) (NCHW / OIHW, padding top, left, bottom, right): every output
    pixel's window of the padded image, its rows and columns stepped by the strides."""
    pt, pl, pb, pr = padding
    xc = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    win = sliding_window_view(xc, w.shape[2:], axis=(2, 3))[:, :, :: strides[0], :: strides[1]]
    return np.einsum("ncyxij,ocij->noyx", win, w.astype(np.int64))


@needs_amx
@pytest.mark.parametrize(
    ("n", "c", "hw", "oc", "kernel", "stride", "padding", "dtype", "zx"),
    [
        # ResNet-50 open_nsfw's stem (padded by its own pad op): 42 quads in 3 steps
        (1, 3, (230, 230), 64, (7, 7), (2, 2), (0, 0, 0, 0), "uint8", 3),
        # the same stem padded by the conv; int8 data (shifted by 128)
        (1, 3, (35, 29), 64, (7, 7), (2, 2), (3, 3, 3, 3), "int8", -5),
        # 9 quads: one step of 36 bytes (narrowed tiles); 13 x 9 output: 16-pixel groups cut
        # at 9, the last block's second group past the last row; 40 channels: the second
        # channel block has 8
        (1, 3, (25, 17), 40, (3, 3), (2, 2), (1, 1, 1, 1), "int8", 7),
        # column stride 4 (a whole 64-byte window); kernel width 6 (taps 6, 7 padded);
        # uneven strides and asymmetric padding; two images; one channel
        (2, 1, (30, 70), 32, (5, 6), (3, 4), (2, 0, 1, 3), "uint8", 255),
        # 4 channels, 19 x 19 output: rows of two groups, the second with 3 real columns
        (1, 4, (39, 38), 48, (3, 3), (2, 2), (1, 1, 0, 1), "int8", -128),
    ],
)
def test_amx_strided_conv2d_matches_numpy(n, c, hw, oc, kernel, stride, padding, dtype, zx):
    shape = ConvShape(n, c, *hw, oc, kernel, stride, padding)
    assert amx_strided_conv_applies(shape)
    rng = np.random.default_rng(c + oc)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (n, c, *hw)).astype(dtype)
    w = rng.integers(-128, 128, (oc, c, *kernel)).astype(np.int8)
    w[0] = -128  # the extreme channel: |sum| up to 147 * 128 * 255
    np.testing.assert_array_equal(_run(shape, x, w, zx), _reference(x, w, zx, stride, padding))


def _run(shape: ConvShape, x: np.ndarray, w: np.ndarray, zx: int) -> np.ndarray:
    """The kernel's int32 output for ``x`` (zero point ``zx``) and the OIHW ``w``."""
    shift = VNNI.shift(str(x.dtype), zx)
    lib = tvm.compile(
        tvm.IRModule({"main": amx_strided_conv2d_kernel(shape, str(x.dtype), shift, zx + shift)}),
        AMX_TARGET,
    )
    args = [x, strided_conv_weight(w), amx_conv_compensation(w, zx + shift)]
    out = tvm.runtime.tensor(np.zeros((shape.batch, w.shape[0], *shape.out_hw), np.int32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


def test_amx_strided_conv_rule():
    def conv(c, oc, kernel=(7, 7), stride=(2, 2)):
        return ConvShape(1, c, 64, 64, oc, kernel, stride)

    assert amx_strided_conv_applies(conv(3, 64))
    assert not amx_strided_conv_applies(conv(5, 64))  # channels fill tile rows: amx_conv2d
    assert not amx_strided_conv_applies(conv(3, 16))  # no complete channel block
    assert not amx_strided_conv_applies(conv(3, 64, stride=(2, 5)))  # past a 64-byte window
    with pytest.raises(ValueError, match="not a shape it covers"):
        amx_strided_conv2d_kernel(conv(3, 16), "int8", 128, 128)


def _stem(x_shape, oc, strides, out_dtype="int8"):
    """main(x: int8) = requantize(qnn.conv2d(x, const w) + bias): a realized stem conv."""
    rng = np.random.default_rng(2)
    w = rng.integers(-128, 128, (oc, x_shape[1], 7, 7)).astype(np.int8)
    x = relax.Var("x", relax.TensorType(x_shape, "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            acc = bb.emit(
                qnn.conv2d(
                    x, relax.const(w), relax.const(np.float32(0.02)), relax.const(np.int32(-7)),
                    relax.const(np.full(oc, 0.01, np.float32)), relax.const(np.zeros(oc, np.int32)),
                    strides=strides, padding=(3, 3, 3, 3),
                )
            )  # fmt: skip
            b = rng.integers(-5000, 5000, (1, oc, 1, 1)).astype(np.int32)
            acc = bb.emit(relax.op.add(acc, relax.const(b)))
            req = qnn.requantize(
                acc, relax.const(rng.uniform(1e-4, 3e-4, oc).astype(np.float32)),
                relax.const(np.zeros(oc, np.int32)), relax.const(np.float32(0.05)),
                relax.const(np.int32(-3 if out_dtype == "int8" else 3)), axis=1, out_dtype=out_dtype,
            )  # fmt: skip
            out = bb.emit_output(bb.emit(req))
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


def _conv_names(mod, target):
    fns = lower_to_cpu_kernels(mod, target).functions
    return {gv.name_hint for gv in fns if gv.name_hint.startswith("autoq_conv2d")}


def test_lowering_puts_strided_stems_on_amx():
    stem = _stem((1, 3, 20, 20), 64, (2, 2))
    assert _conv_names(stem, AMX_TARGET) == {"autoq_conv2d_amx_strided"}
    # stride 1, or fewer than 32 output channels: the VNNI kernel
    assert _conv_names(_stem((1, 3, 20, 20), 64, (1, 1)), AMX_TARGET) == {"autoq_conv2d_vnni"}
    assert _conv_names(_stem((1, 3, 20, 20), 16, (2, 2)), AMX_TARGET) == {"autoq_conv2d_vnni"}
    znver4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    assert _conv_names(stem, znver4) == {"autoq_conv2d_vnni"}


@needs_amx
@pytest.mark.parametrize("out_dtype", ["int8", "uint8"])
def test_stem_on_amx_same_as_generic_lowering(out_dtype):
    mod = _stem((1, 3, 45, 38), 48, (2, 2), out_dtype)
    rng = np.random.default_rng(3)
    x = tvm.runtime.tensor(rng.integers(-128, 128, (1, 3, 45, 38)).astype(np.int8))
    outs = [
        relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=use), tvm.cpu())["main"](x)
        for target, use in ((AMX_TARGET, True), (HOST_TARGET, False))
    ]
    assert outs[0].numpy().dtype == np.dtype(out_dtype)
    np.testing.assert_array_equal(outs[0].numpy(), outs[1].numpy())
