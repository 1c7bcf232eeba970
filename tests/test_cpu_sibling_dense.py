"""autoq.cpu.sibling_dense: dynamic dense layers that read the same per-token quantized input
(a transformer's query / key / value projections) run as one packed kernel call on the
concatenated weights; each layer's int32 output equals numpy's ``(q - z) @ w.T`` (int64)
bit for bit, on VNNI and AVX2 (``mcpu=haswell``). Layers with another input or another
zero point keep their own call."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import qnn
from autoq.cpu import amx, sibling_dense
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.ir.toolkit import bindings, is_call
from autoq.qnn.runtime_qparams import dynamic_quantize

HOST = tvm.target.codegen.llvm_get_system_cpu()
FLAGS = amx.cpu_flags(open("/proc/cpuinfo").read())
TARGETS = [
    pytest.param(
        {"mcpu": HOST},
        marks=pytest.mark.skipif("avx512_vnni" not in FLAGS, reason="this CPU has no VNNI"),
        id="vnni",
    ),
    pytest.param(
        {"mcpu": "haswell"},
        marks=pytest.mark.skipif("avx2" not in FLAGS, reason="this CPU has no AVX2"),
        id="avx2",
    ),
]
M, K = 13, 40
SIBLINGS = (29, 16, 35)  # output channels of the layers reading x's quantization


def _module(weights: list[np.ndarray], other: np.ndarray):
    """main(x, y) = (qnn.dense(dq(x), w) for w in weights) + qnn.dense(dq(y), other): the
    first group shares one ``qnn.dynamic_quantize``, the last layer has its own."""
    x = relax.Var("x", relax.TensorType((1, M, K), "float32"))
    y = relax.Var("y", relax.TensorType((1, M, K), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            outs = []
            for data, ws in ((x, weights), (y, [other])):
                dq = bb.emit(qnn.dynamic_quantize(data, granularity="token"))
                q, s, z = (bb.emit(relax.TupleGetItem(dq, i)) for i in range(3))
                for w in ws:
                    sw = relax.const(np.full(w.shape[0], 0.01, np.float32))
                    zw = relax.const(np.zeros(w.shape[0], np.int32))
                    outs.append(bb.emit(qnn.dense(q, relax.const(w), s, z, sw, zw)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]})


def _kernel_calls(mod) -> int:
    """call_tir bindings of ``main`` that call a packed dense kernel."""
    calls = [v for _, v in bindings(mod["main"]) if is_call(v, "relax.call_tir")]
    return sum(c.args[0].name_hint.startswith("autoq_dense_") for c in calls)


def _weights(rng, n: int) -> np.ndarray:
    return rng.integers(-127, 128, size=(n, K), dtype=np.int8)


@pytest.mark.parametrize("attrs", TARGETS)
def test_siblings_share_one_kernel_bit_exact(attrs):
    rng = np.random.default_rng(7)
    weights, other = [_weights(rng, n) for n in SIBLINGS], _weights(rng, 24)
    mod = _module(weights, other)
    target = tvm.target.Target({"kind": "llvm", **attrs})
    assert _kernel_calls(lower_to_cpu_kernels(mod, target)) == 2  # the group, the other
    x, y = (rng.normal(size=(1, M, K)).astype(np.float32) * 2 for _ in range(2))
    x[0, 3] = 0.0  # an all-zero row: scale 1, zero point 0
    vm = relax.VirtualMachine(autoq.compile(mod, target), tvm.cpu())
    got = [o.numpy() for o in vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))]
    want = []
    for data, ws in ((x, weights), (y, [other])):
        q, _s, z = dynamic_quantize(data, "token", "int8")
        want += [(q.astype(np.int64) - z) @ w.astype(np.int64).T for w in ws]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_lone_layers_unchanged():
    """One dense per quantized input: nothing to merge, the module is returned as is."""
    rng = np.random.default_rng(1)
    mod = _module([_weights(rng, 16)], _weights(rng, 16))
    calls = []
    out = sibling_dense.merge_sibling_dense(mod, lambda c: calls.append(c), None)
    assert out.same_as(mod) and len(calls) == 2  # both dense calls were looked at


def test_doctests():
    assert doctest.testmod(sibling_dense).failed == 0
