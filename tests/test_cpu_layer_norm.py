"""autoq.cpu.layer_norm: the row-parallel float32 layer norm, bit for bit against TVM's generic
lowering (and close to numpy's float64 layer norm), and where the CPU lowering picks it."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from test_cpu_kernels import PATHS  # the two ISA paths, skipped where the CPU lacks one
from tvm import relax

import autoq
from autoq.cpu import lane_transpose
from autoq.cpu import layer_norm as layer_norm_mod
from autoq.cpu.layer_norm import layer_norm_kernel
from autoq.cpu.lowering import lower_to_cpu_kernels

HOST_CPU = tvm.target.codegen.llvm_get_system_cpu()
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": HOST_CPU})
EPS = 1e-5


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) * 3 + 1).astype(np.float32)
    gamma = rng.normal(size=shape[-1]).astype(np.float32)
    beta = rng.normal(size=shape[-1]).astype(np.float32)
    return x, gamma, beta


def _layer_norm_vm(x, gamma, beta, axis, cpu_kernels):
    """layer_norm(x) over ``axis`` compiled by autoq with or without its CPU kernels."""
    v = relax.Var("x", relax.TensorType(x.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [v]):
        g, b = relax.const(gamma), relax.const(beta)
        bb.emit_func_output(bb.emit(relax.op.nn.layer_norm(v, g, b, [axis], EPS)))
    mod = bb.get()
    ex = autoq.compile(mod, TARGET, cpu_kernels=cpu_kernels)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    return mod, out


def _numpy_layer_norm(x, gamma, beta):
    x64 = x.astype(np.float64)
    mean = x64.mean(-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdims=True)
    return (x64 - mean) / np.sqrt(var + EPS) * gamma + beta


@pytest.mark.parametrize(
    "shape",
    [
        (1, 128, 384),  # all-MiniLM-L6-v2: 8 whole (transposed) row blocks
        (2, 3, 40),  # one partial block, a scalar tail of 8
        (37, 16),  # two whole blocks and a partial one, no tail
        (5, 7),  # no whole vector
        (40, 48),  # two whole (transposed) blocks and a partial one
    ],
)
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_kernel_same_floats_as_generic_lowering(isa, mcpu, shape):
    del isa  # the kernel is the same PrimFunc on both paths
    x, gamma, beta = _inputs(shape)
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    lib = tvm.compile(layer_norm_kernel(shape, EPS), target)
    out = tvm.runtime.empty(shape, "float32")
    lib["layer_norm"](*[tvm.runtime.tensor(a) for a in (x, gamma, beta)], out)
    got = out.numpy()
    _, ref = _layer_norm_vm(x, gamma, beta, len(shape) - 1, cpu_kernels=False)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_allclose(got, _numpy_layer_norm(x, gamma, beta), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("axis", "kernel"), [(2, True), (-1, True), (1, False)])
def test_lowered_where_covered_same_floats(axis, kernel):
    """The last axis runs on the kernel, another axis on TVM's own layer norm (which takes
    gamma / beta of that axis's length); the floats are the generic lowering's either way."""
    x = _inputs((2, 32, 32), seed=1)[0]  # the last axis: 4 whole blocks of whole vectors
    _, gamma, beta = _inputs((32,), seed=2)
    mod, got = _layer_norm_vm(x, gamma, beta, axis, cpu_kernels=True)
    names = {gv.name_hint for gv in lower_to_cpu_kernels(mod, TARGET).functions}
    assert ("autoq_layer_norm" in names) == kernel, (axis, sorted(names))
    _, ref = _layer_norm_vm(x, gamma, beta, axis, cpu_kernels=False)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_realized_layer_norm_block_same_outputs():
    """SmoothQuant's test block realized (its two layer norms on the kernel): the same outputs
    as the generic lowering, bit for bit."""
    from models import ln_block, ln_block_data

    mod, params, _ = ln_block()
    qmod = autoq.quantize(mod, params, ln_block_data(2, 1), autoq.Config(recipe="cnn"))
    names = [gv.name_hint for gv in lower_to_cpu_kernels(qmod, TARGET).functions]
    assert "autoq_layer_norm" in names, sorted(names)  # one PrimFunc of this shape
    assert not any(n.startswith("layer_norm") for n in names), sorted(names)  # no generic one
    x = tvm.runtime.tensor(ln_block_data(1, 7)[0])
    outs = []
    for cpu_kernels in (True, False):
        ex = autoq.compile(qmod, TARGET, cpu_kernels=cpu_kernels)
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](x).numpy())
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_doctests():
    assert doctest.testmod(layer_norm_mod).failed == 0
    assert doctest.testmod(lane_transpose).failed == 0
