"""autoq.cpu.pool_requantize: a requantize moved below an edge pad and a max pool.

Before / Expected modules (tvm.ir.assert_structural_equal) for ResNet's stem shape
(``dequantize -> replicate pad (call_tir) -> quantize -> max_pool2d``); the rewritten module
compiled (CPU kernels on, AVX2 via "haswell" and the host) against the generic lowering
without the rewrite and a numpy reference (numpy.pad, a window max, primitives); the chains
that must stay as they are.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax, topi

import autoq
from autoq import primitives as P
from autoq import qnn
from autoq.cpu import amx, pool_requantize
from autoq.cpu.pool_requantize import edge_pad_widths, requantize_after_pools

HOST = tvm.target.codegen.llvm_get_system_cpu()
FLAGS = amx.cpu_flags(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
# (target, the /proc/cpuinfo flag it needs, test id)
_ISAS = [({"kind": "llvm", "mcpu": "haswell"}, "avx2", "avx2"),
         ({"kind": "llvm", "mcpu": HOST}, "avx512_vnni", "vnni")]  # fmt: skip
TARGETS = [
    pytest.param(t, marks=pytest.mark.skipif(f not in FLAGS, reason=f"no {f}"), id=i)
    for t, f, i in _ISAS
]
SHAPE = (1, 16, 12, 12)
S1, Z1, S2, Z2 = np.float32(0.0099), -128, np.float32(0.0098), -120


def c(v, dtype):
    return relax.const(np.asarray(v, dtype), dtype)


def _module(body, dtype="int8", shape=SHAPE) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(body(bb, x))
        bb.emit_func_output(gv)
    return bb.get()


def _stem(bb, x, pool_padding=(0, 0), pad_after=(0, 0, 1, 1)):
    """ResNet's stem as realize leaves it: the fp32 edge pad between its own grids."""
    d = bb.emit(qnn.dequantize(x, c(S1, "float32"), c(Z1, "int32")))
    p = bb.emit_te(topi.nn.replicate_pad, d, [0, 0, 0, 0], list(pad_after))
    q = bb.emit(qnn.quantize(p, c(S2, "float32"), c(Z2, "int32"), out_dtype="int8"))
    return bb.emit(relax.op.nn.max_pool2d(q, 3, 2, padding=pool_padding))


def _expected(bb, x):
    # the pad folded into the pool: its last window (rows 10..12 of the 13) still reads row 11
    m = bb.emit(relax.op.nn.max_pool2d(x, 3, 2, padding=(0, 0, 1, 1)))
    return bb.emit(qnn.requantize(m, c(S1, "float32"), c(Z1, "int32"), c(S2, "float32"),
                                  c(Z2, "int32"), out_dtype="int8"))  # fmt: skip


def _same(got: tvm.IRModule, expected: tvm.IRModule) -> None:
    canonical = relax.transform.CanonicalizeBindings()  # output aliases aside
    got, expected = (canonical(tvm.IRModule({"main": m["main"]})) for m in (got, expected))
    tvm.ir.assert_structural_equal(got["main"], expected["main"], map_free_vars=True)


def test_stem_pad_and_pool_run_on_codes():
    _same(requantize_after_pools(_module(_stem)), _module(_expected))


def _requantize_pool(rounding, padding=(0, 0), in_dtype="int8"):
    def body(bb, x):
        r = bb.emit(qnn.requantize(x, c(S1, "float32"), c(Z1, "int32"), c(S2, "float32"),
                                   c(Z2, "int32"), out_dtype="int8", rounding=rounding))  # fmt: skip
        return bb.emit(relax.op.nn.max_pool2d(r, 3, 2, padding=padding))

    return _module(body, in_dtype)


def test_requantize_moves_below_a_max_pool():
    def expected(bb, x):
        m = bb.emit(relax.op.nn.max_pool2d(x, 3, 2))
        return bb.emit(qnn.requantize(m, c(S1, "float32"), c(Z1, "int32"), c(S2, "float32"),
                                      c(Z2, "int32"), out_dtype="int8", rounding="half_even"))  # fmt: skip

    _same(requantize_after_pools(_requantize_pool("half_even")), _module(expected))


@pytest.mark.parametrize(
    "mod",
    [
        pytest.param(_requantize_pool("float", padding=(1, 1)), id="padded_pool"),
        pytest.param(_requantize_pool("float", in_dtype="int32"), id="accumulator"),
    ],
)
def test_chains_that_stay(mod):
    # a padded pool's padding is the input dtype's minimum, which the requantize does not
    # keep; an accumulator's requantize stays in its kernel's epilogue
    _same(requantize_after_pools(mod), mod)


def test_padded_pool_keeps_the_requantize_before_it():
    def expected(bb, x):
        p = bb.emit(relax.op.nn.pad(x, [0, 0, 0, 0, 0, 1, 0, 1], "replicate"))
        r = bb.emit(qnn.requantize(p, c(S1, "float32"), c(Z1, "int32"), c(S2, "float32"),
                                   c(Z2, "int32"), out_dtype="int8"))  # fmt: skip
        return bb.emit(relax.op.nn.max_pool2d(r, 3, 2, padding=(1, 1)))

    got = requantize_after_pools(_module(lambda bb, x: _stem(bb, x, pool_padding=(1, 1))))
    _same(got, _module(expected))


@pytest.mark.parametrize(
    ("width", "pool", "folded"),
    [
        ([0, 0, 0, 0, 1, 0, 0, 1], dict(pool_size=3, strides=2), (1, 0, 0, 1)),
        ([0, 0, 0, 0, 2, 2, 2, 2], dict(pool_size=3, strides=1), (2, 2, 2, 2)),
        ([0, 0, 0, 0, 0, 3, 0, 3], dict(pool_size=3, strides=2), None),  # a window of copies
        ([0, 0, 0, 0, 3, 0, 3, 0], dict(pool_size=3, strides=1), None),
        ([0, 0, 1, 1, 0, 0, 0, 0], dict(pool_size=3, strides=2), None),  # channels padded
    ],
)
def test_edge_pad_folds_into_the_pool(width, pool, folded):
    def before(bb, x):
        p = bb.emit(relax.op.nn.pad(x, width, "replicate"))
        return bb.emit(relax.op.nn.max_pool2d(p, **pool))

    mod = _module(before)
    if folded is None:
        _same(requantize_after_pools(mod), mod)
        return
    expected = _module(lambda bb, x: bb.emit(relax.op.nn.max_pool2d(x, **pool, padding=folded)))
    _same(requantize_after_pools(mod), expected)
    # the same numbers from TVM's own pad and pool (no autoq kernel, no rewrite)
    x = np.random.default_rng(4).integers(-128, 128, SHAPE).astype(np.int8)
    target = tvm.target.Target({"kind": "llvm"})
    outs = [relax.VirtualMachine(tvm.compile(m, target), tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy() for m in (mod, expected)]  # fmt: skip
    np.testing.assert_array_equal(outs[0], outs[1])


def _pad_func(fn, *args):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 3, 5, 6], "float32"))
    with bb.function("main", [x]):
        gv = bb.emit_te(fn, x, *args)
        bb.emit_func_output(gv)
    mod = bb.get()
    return next(f for gv, f in mod.functions_items() if gv.name_hint != "main")


@pytest.mark.parametrize(
    ("before", "after"), [([0, 0, 0, 1], [0, 0, 2, 0]), ([0, 1, 2, 3], [0, 0, 1, 2])]
)
def test_edge_pad_widths(before, after):
    f = _pad_func(topi.nn.replicate_pad, before, after)
    assert edge_pad_widths(f) == list(zip(before, after, strict=True))


def test_edge_pad_widths_rejects_other_kernels():
    assert edge_pad_widths(_pad_func(topi.nn.mirror_pad, [0, 0, 1, 1], [0, 0, 1, 1])) is None
    assert edge_pad_widths(_pad_func(topi.nn.pad, [0, 0, 1, 1], [0, 0, 1, 1], 0.0)) is None
    assert edge_pad_widths(_pad_func(topi.flip, 2)) is None
    assert edge_pad_widths(_pad_func(lambda x: topi.multiply(x, 2.0))) is None


def _reference(x: np.ndarray) -> np.ndarray:
    """numpy: dequantize, edge pad, quantize, 3x3 / 2 window max."""
    d = P.dequantize(x, S1, Z1)
    p = np.pad(d, [(0, 0), (0, 0), (0, 1), (0, 1)], mode="edge")
    q = P.quantize(p, S2, Z2, "int8")
    n = (q.shape[2] - 3) // 2 + 1
    win = [
        q[:, :, i : i + 2 * n - 1 : 2, j : j + 2 * n - 1 : 2] for i in range(3) for j in range(3)
    ]
    return np.max(win, axis=0)


@pytest.mark.parametrize("target", TARGETS)
def test_stem_numbers_unchanged(target):
    target = tvm.target.Target(target)
    rng = np.random.default_rng(3)
    x = rng.integers(-128, 128, SHAPE).astype(np.int8)
    x.reshape(-1)[:256] = np.arange(-128, 128)  # every code
    mod = _module(_stem)
    outs = []
    for kernels in (True, False):  # the rewrite runs in the CPU kernels' lowering
        ex = autoq.compile(mod, target, cpu_kernels=kernels)
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], _reference(x))


def test_doctests():
    assert doctest.testmod(pool_requantize).failed == 0
