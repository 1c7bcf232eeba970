"""autoq.cpu.max_pool: the separable int8 / uint8 max pool against TVM's own max_pool2d and a
numpy window max, bit for bit, on the AVX2 ("haswell") and host targets: strides, padding
(the dtype's minimum), ceil_mode, non-square windows; and the pools it leaves to TVM."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq.cpu import max_pool
from autoq.cpu.lowering import lower_to_cpu_kernels

HOST = tvm.target.codegen.llvm_get_system_cpu()
TARGETS = [{"kind": "llvm", "mcpu": "haswell"}, {"kind": "llvm", "mcpu": HOST}]
# shape, dtype, pool attrs
CASES = {
    "stem": ((1, 16, 13, 13), "int8", dict(pool_size=3, strides=2)),
    "padded": ((1, 8, 12, 11), "uint8", dict(pool_size=3, strides=2, padding=(1, 0, 1, 2))),
    "ceil": ((2, 4, 10, 9), "int8", dict(pool_size=3, strides=2, ceil_mode=True)),
    "window_2x3": ((1, 5, 9, 14), "uint8", dict(pool_size=(2, 3), strides=(1, 2))),
    "stride_1": ((1, 3, 7, 7), "int8", dict(pool_size=3, strides=1, padding=1)),
}


def _module(shape, dtype, attrs) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.nn.max_pool2d(x, **attrs))
        bb.emit_func_output(gv)
    return bb.get()


def _reference(x, pool, strides, padding, out_hw):
    """numpy: pad with the dtype's minimum (and past the input for ceil_mode windows), take
    every window's max."""
    (kh, kw), (sh, sw), (oh, ow) = pool, strides, out_hw
    top, left = padding[0], padding[1]
    low = np.iinfo(x.dtype).min
    big = np.full((*x.shape[:2], (oh - 1) * sh + kh, (ow - 1) * sw + kw), low, x.dtype)
    h = min(x.shape[2], big.shape[2] - top)
    w = min(x.shape[3], big.shape[3] - left)
    big[:, :, top : top + h, left : left + w] = x[:, :, :h, :w]
    out = np.full((*x.shape[:2], oh, ow), low, x.dtype)
    for i in range(kh):
        for j in range(kw):
            out = np.maximum(out, big[:, :, i : i + sh * oh : sh, j : j + sw * ow : sw])
    return out


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


@pytest.mark.parametrize("target", TARGETS, ids=["avx2", "host"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_max_pool_kernel_same_as_tvm_and_numpy(target, case):
    target = tvm.target.Target(target)
    shape, dtype, attrs = CASES[case]
    mod = _module(shape, dtype, attrs)
    names = [gv.name_hint for gv in lower_to_cpu_kernels(mod, target).functions]
    assert "autoq_max_pool2d" in names
    info = np.iinfo(dtype)
    x = np.random.default_rng(len(case)).integers(info.min, info.max + 1, shape).astype(dtype)
    x.reshape(-1)[:5] = info.min  # windows of minimums next to padding
    outs = []
    for kernels in (True, False):
        ex = autoq.compile(mod, target, cpu_kernels=kernels)
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    pad = attrs.get("padding", 0)
    pad = (pad,) * 4 if isinstance(pad, int) else tuple(pad) * (4 // len(pad))
    ref = _reference(x, _pair(attrs["pool_size"]), _pair(attrs["strides"]), pad, outs[0].shape[2:])
    np.testing.assert_array_equal(outs[0], ref)


@pytest.mark.parametrize(
    ("dtype", "attrs"),
    [("float32", dict(pool_size=3, strides=2)), ("int8", dict(pool_size=3, dilation=2))],
)
def test_pools_left_to_tvm(dtype, attrs):
    mod = _module((1, 4, 9, 9), dtype, attrs)
    names = [
        gv.name_hint for gv in lower_to_cpu_kernels(mod, tvm.target.Target(TARGETS[0])).functions
    ]
    assert "autoq_max_pool2d" not in names


def test_doctests():
    assert doctest.testmod(max_pool).failed == 0
