"""autoq.cpu.softmax_dequantize: a last-axis softmax of a per-tensor ``qnn.dequantize`` runs
as one softmax kernel reading the int8 / uint8 codes, with the same floats, bit for bit, as
today's kernel on the dequantized tensor and as TVM's generic lowering (except the
denormal probabilities the kernel flushes to 0)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from test_cpu_kernels import PATHS  # the two ISA paths, skipped where the CPU lacks one
from tvm import relax

import autoq
from autoq import qnn
from autoq.cpu import softmax_dequantize as fold_mod
from autoq.cpu.isa import VNNI
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.softmax import softmax_kernel, softmax_table

TINY = np.finfo(np.float32).tiny
TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _codes(rng, shape, dtype):
    """Codes with the second half of every row ~100 below the first (an attention mask's
    scores: denormal exponentials)."""
    lo, hi = (-128, 128) if dtype == "int8" else (0, 256)
    q = rng.integers(lo, hi, size=shape)
    q[..., shape[-1] // 2 :] = lo + rng.integers(0, 8, size=q[..., shape[-1] // 2 :].shape)
    return q.astype(dtype)


def _numpy_dequantize(q, scale, zero):
    return (q.astype(np.int32) - zero).astype(np.float32) * np.float32(scale)


def _run(kernel, mcpu, data):
    lib = tvm.compile(
        tvm.IRModule({"main": kernel}), tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
    )
    out = tvm.runtime.tensor(np.zeros(data.shape, np.float32))
    lib["main"](tvm.runtime.tensor(data), tvm.runtime.tensor(softmax_table()), out)
    return out.numpy()


@pytest.mark.parametrize(
    ("shape", "dtype", "scale", "zero"),
    [
        ((2, 3, 40, 40), "int8", 0.63001877, 54),
        ((5, 37), "uint8", 0.39215687, 127),
        ((7, 9), "int8", 2.5, -3),
    ],
)
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_kernel_on_codes_same_bits_as_on_dequantized_floats(isa, mcpu, shape, dtype, scale, zero):
    q = _codes(np.random.default_rng(0), shape, dtype)
    x = _numpy_dequantize(q, scale, zero)
    permute = isa is VNNI
    got = _run(softmax_kernel(shape, -1, permute, (dtype, scale, zero)), mcpu, q)
    want = _run(softmax_kernel(shape, -1, permute), mcpu, x)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-30)


def _model(shape, dtype, scale, zero, also_exp: bool):
    """softmax(dequantize(q)) (and, ``also_exp``, exp of the same dequantize: a second use)."""
    q = relax.Var("q", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [q]):
        x = bb.emit(qnn.dequantize(q, relax.const(scale, "float32"), relax.const(zero, "int32")))
        out = bb.emit(relax.op.nn.softmax(x, axis=-1))
        if also_exp:
            out = bb.emit(relax.Tuple([out, bb.emit(relax.op.exp(x))]))
        bb.emit_func_output(out)
    return bb.get()


def _outputs(mod, q, cpu_kernels: bool):
    vm = relax.VirtualMachine(autoq.compile(mod, TARGET, cpu_kernels=cpu_kernels), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(q))
    return [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [t.numpy() for t in out]


@pytest.mark.parametrize("also_exp", [False, True])
def test_lowered_softmax_reads_the_codes_same_floats_as_generic(also_exp):
    shape, dtype, scale, zero = (1, 2, 16, 24), "int8", 0.6300188, 54
    mod = _model(shape, dtype, scale, zero, also_exp)
    main = lower_to_cpu_kernels(mod, TARGET)["main"]
    calls = [b.value for blk in main.body.blocks for b in blk.bindings]
    soft = [c for c in calls if "autoq_softmax" in str(getattr(c, "args", [""])[0])]
    assert len(soft) == 1 and soft[0].args[1].fields[0].same_as(main.params[0])
    deq = [c for c in calls if "dequantize" in str(getattr(c, "args", [""])[0])]
    assert len(deq) == int(also_exp)  # removed where only the softmax read it
    q = _codes(np.random.default_rng(1), shape, dtype)
    got, ref = _outputs(mod, q, True), _outputs(mod, q, False)
    normal = ref[0] >= TINY
    assert np.any(~normal & (ref[0] > 0)), "the case must contain denormal probabilities"
    np.testing.assert_array_equal(got[0][normal].view(np.int32), ref[0][normal].view(np.int32))
    assert not np.any(got[0][~normal])
    if also_exp:
        np.testing.assert_array_equal(got[1], ref[1])


def test_not_folded_per_channel_or_inner_axis():
    shape = (2, 4, 16)
    q = relax.Var("q", relax.TensorType(shape, "int8"))
    per_channel = qnn.dequantize(
        q, relax.const(np.full(16, 0.5, np.float32)), relax.const(np.zeros(16, np.int32))
    )
    per_tensor = qnn.dequantize(q, relax.const(0.5, "float32"), relax.const(0, "int32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [q]):
        a, b = bb.emit(per_channel), bb.emit(per_tensor)
        value_of = {a: per_channel, b: per_tensor}
        bb.emit_func_output(a)
    assert fold_mod.softmax_of_codes(relax.op.nn.softmax(a, axis=-1), value_of) is None
    assert fold_mod.softmax_of_codes(relax.op.nn.softmax(b, axis=1), value_of) is None
    codes, got_shape, dq = fold_mod.softmax_of_codes(relax.op.nn.softmax(b, axis=2), value_of)
    assert codes.same_as(q) and got_shape == shape and dq == ("int8", 0.5, 0)


def test_doctests():
    assert doctest.testmod(fold_mod).failed == 0


def _numpy_quantize(p, scale, zero, dtype):
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    return np.clip(np.round(p / np.float32(scale)) + zero, lo, hi).astype(dtype)


@pytest.mark.parametrize(
    ("shape", "dequantize", "quantize"),
    [
        # MiniLM's attention: 1/255 (r s - 1 = -6e-8: two corrections needed in general)
        ((2, 3, 40, 40), ("int8", 0.63001877, 54), ("int8", 1 / 255, -128)),
        # rows of 37 (a scalar tail), uint8 in and out, a scale just below 1/128
        ((5, 37), ("uint8", 0.39215687, 127), ("uint8", 0.0078125 * (1 - 2**-23), 0)),
        # a coarse input grid: exponentials e^-2.5k, many between 2**-96 and 2**-62
        ((7, 33), ("int8", 2.5, -3), ("int8", 0.0039215689, -128)),
        # float input, x - max down to -95: exponentials flushed, below 2**-96, below 2**-62
        ((512, 50), None, ("int8", 0.0039215689, -128)),
    ],
)
@pytest.mark.parametrize(("isa", "mcpu"), PATHS)
def test_quantized_softmax_same_codes_as_quantize_of_probabilities(isa, mcpu, shape, dequantize,
                                                                   quantize):  # fmt: skip
    """The codes of ``softmax_kernel(..., quantize=)`` against numpy's quantize (a true
    division, round half to even) of the float kernel's probabilities."""
    rng = np.random.default_rng(2)
    if dequantize is None:
        q = rng.normal(0, 3, shape) - rng.uniform(0, 95, shape) * (rng.random(shape) < 0.3)
        q = q.astype(np.float32)
    else:
        q = _codes(rng, shape, dequantize[0])
    permute = isa is VNNI
    p = _run(softmax_kernel(shape, -1, permute, dequantize), mcpu, q)
    lib = tvm.compile(
        tvm.IRModule({"main": softmax_kernel(shape, -1, permute, dequantize, quantize)}),
        tvm.target.Target({"kind": "llvm", "mcpu": mcpu}),
    )
    out = tvm.runtime.tensor(np.zeros(shape, quantize[0]))
    lib["main"](tvm.runtime.tensor(q), tvm.runtime.tensor(softmax_table()), out)
    want = _numpy_quantize(p, *quantize[1:], quantize[0])
    assert len(np.unique(want)) >= 4, "the case must cover several codes"
    np.testing.assert_array_equal(out.numpy(), want)


def test_lowered_quantize_of_softmax_is_one_kernel_same_codes_as_generic():
    """quantize(softmax(dequantize(q))): one softmax call writing int8, no quantize left; the
    codes of the generic lowering. With a second reader of the probabilities, not folded."""
    shape = (1, 2, 16, 24)
    q = relax.Var("q", relax.TensorType(shape, "int8"))
    for second in (False, True):
        bb = relax.BlockBuilder()
        with bb.function("main", [q]):
            x = bb.emit(qnn.dequantize(q, relax.const(0.6300188, "float32"), relax.const(54)))
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            c = bb.emit(qnn.quantize(p, relax.const(1 / 255, "float32"), relax.const(-128)))
            bb.emit_func_output(bb.emit(relax.Tuple([c, p])) if second else c)
        mod = bb.get()
        main = lower_to_cpu_kernels(mod, TARGET)["main"]
        calls = [str(b.value.args[0]) for blk in main.body.blocks for b in blk.bindings
                 if isinstance(b.value, relax.Call) and b.value.args]  # fmt: skip
        assert sum("quantize" in c and "dequantize" not in c for c in calls) == int(second)
        assert sum("autoq_softmax" in c for c in calls) == 1
        data = _codes(np.random.default_rng(4), shape, "int8")
        got, ref = _outputs(mod, data, True), _outputs(mod, data, False)
        np.testing.assert_array_equal(got[0], ref[0])
