"""autoq.ir.canonicalize: every frontend decomposition becomes one canonical form.

Before / Expected modules built by hand (tvm.ir.assert_structural_equal), numerics against
numpy definitions of the activations, the leak rule (a value the graph reads elsewhere is
never folded into a canonical op), and the end-to-end property: the same torch network
imported with ``from_torch`` and through ONNX (``from_onnx``) canonicalizes to the same graph.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax

from autoq.ir.canonicalize import canonicalize, hardsigmoid, hardswish
from models import TARGET, torch_cnn

F32 = "float32"


def c(v):
    return relax.const(np.asarray(v, F32), F32)


def module(body, shape=(1, 4, 5), extra_outputs: bool = False) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(shape), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = body(bb, x)
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def check(before, expected) -> None:
    tvm.ir.assert_structural_equal(
        canonicalize(before)["main"], canonicalize(expected)["main"], map_free_vars=True
    )


def run(mod, x):
    ex = tvm.compile(mod, TARGET)
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_torch_hardswish():
    """torch.export: (x * clip(clip(x + 3, 0, inf), -inf, 6)) / 6."""

    def body(bb, x):
        a = bb.emit(relax.op.add(x, c(3.0)))
        h = bb.emit(relax.op.clip(bb.emit(relax.op.clip(a, 0, math.inf)), -math.inf, 6))
        return relax.op.divide(bb.emit(relax.op.multiply(x, h)), c(6.0))

    check(module(body), module(lambda bb, x: hardswish(x)))


def test_onnx_hardswish_either_operand_order():
    """torch.onnx: x * clip(x * (1/6) + 0.5, 0, 1), the multiply written either way round."""

    def body(order):
        def f(bb, x):
            s = bb.emit(relax.op.multiply(c(1 / 6), x) if order else relax.op.multiply(x, c(1 / 6)))
            h = bb.emit(relax.op.clip(bb.emit(relax.op.add(s, c(0.5))), 0, 1))
            return relax.op.multiply(h, x) if order else relax.op.multiply(x, h)

        return f

    for order in (True, False):
        check(module(body(order)), module(lambda bb, x: hardswish(x)))


def test_hardsigmoid_with_another_alpha_is_left_alone():
    """ONNX HardSigmoid's default alpha is 0.2, not 1/6: clip(0.2 x + 0.5, 0, 1) is not
    torch's hardsigmoid and must stay as it is."""

    def body(alpha):
        return lambda bb, x: relax.op.clip(
            bb.emit(relax.op.add(bb.emit(relax.op.multiply(x, c(alpha))), c(0.5))), 0, 1
        )

    check(module(body(1 / 6)), module(lambda bb, x: hardsigmoid(x)))
    after = canonicalize(module(body(0.2)))["main"]
    ops = [b.value.op.name for blk in after.body.blocks for b in blk.bindings]
    assert ops == ["relax.multiply", "relax.add", "relax.clip"]


def test_silu_gelu_and_gelu_tanh():
    def silu(bb, x):
        return relax.op.multiply(x, bb.emit(relax.op.sigmoid(x)))

    check(module(silu), module(lambda bb, x: relax.op.nn.silu(x)))

    def gelu(bb, x):
        e = bb.emit(relax.op.erf(bb.emit(relax.op.divide(x, c(math.sqrt(2.0))))))
        inner = bb.emit(relax.op.multiply(x, bb.emit(relax.op.add(e, c(1.0)))))
        return relax.op.multiply(inner, c(0.5))

    check(module(gelu), module(lambda bb, x: relax.op.nn.gelu(x)))

    def gelu_tanh(bb, x):
        cube = bb.emit(relax.op.multiply(x, bb.emit(relax.op.multiply(x, x))))
        inner = bb.emit(relax.op.add(x, bb.emit(relax.op.multiply(c(0.044715), cube))))
        t = bb.emit(relax.op.tanh(bb.emit(relax.op.multiply(c(math.sqrt(2 / math.pi)), inner))))
        return relax.op.multiply(
            c(0.5), bb.emit(relax.op.multiply(x, bb.emit(relax.op.add(c(1.0), t))))
        )

    check(module(gelu_tanh), module(lambda bb, x: relax.op.nn.gelu_tanh(x)))


def test_layer_norm_decomposition():
    gamma = np.linspace(0.5, 1.5, 5).astype(np.float32)
    beta = np.linspace(-0.1, 0.1, 5).astype(np.float32)

    def before(bb, x):
        mean = bb.emit(relax.op.mean(x, axis=[-1], keepdims=True))
        d = bb.emit(relax.op.subtract(x, mean))
        var = bb.emit(relax.op.mean(bb.emit(relax.op.power(d, c(2.0))), axis=[-1], keepdims=True))
        n = bb.emit(relax.op.divide(d, bb.emit(relax.op.sqrt(bb.emit(relax.op.add(var, c(1e-5)))))))
        return relax.op.add(bb.emit(relax.op.multiply(n, c(gamma))), c(beta))

    def expected(bb, x):
        return relax.op.nn.layer_norm(x, c(gamma), c(beta), [2], float(np.float32(1e-5)))

    check(module(before), module(expected))


def test_clip_chains_merge_and_float_conv_loses_its_out_dtype():
    def before(bb, x):
        return relax.op.clip(bb.emit(relax.op.clip(x, 0, math.inf)), -math.inf, 6)

    check(module(before), module(lambda bb, x: relax.op.clip(x, 0, 6)))
    w = c(np.ones((2, 1, 1, 1)))

    def conv(out_dtype):
        return lambda bb, x: relax.op.nn.conv2d(x, w, out_dtype=out_dtype)

    check(module(conv("float32"), (1, 1, 3, 3)), module(conv(None), (1, 1, 3, 3)))


def test_a_value_read_elsewhere_is_not_folded_into_a_canonical_op():
    """silu = x * sigmoid(x) where the sigmoid is also returned: rewriting would hide the
    value the second reader sees (a pre-quantized file may round it there), so nothing
    changes."""

    def body(bb, x):
        s = bb.emit(relax.op.sigmoid(x))
        return relax.Tuple([bb.emit(relax.op.multiply(x, s)), s])

    before = module(body)
    tvm.ir.assert_structural_equal(canonicalize(before)["main"], before["main"])


@pytest.mark.parametrize(
    "name, ref",
    [
        ("hardswish", lambda x: x * np.clip(x + 3, 0, 6) / 6),
        ("hardsigmoid", lambda x: np.clip(x + 3, 0, 6) / 6),
    ],
)
def test_canonical_ops_compute_their_definition(name, ref):
    x = np.linspace(-5, 5, 20, dtype=np.float32).reshape(1, 4, 5)
    op = hardswish if name == "hardswish" else hardsigmoid
    np.testing.assert_allclose(run(module(lambda bb, v: op(v)), x), ref(x), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ torch vs ONNX import


def test_torch_and_onnx_imports_of_one_network_canonicalize_to_the_same_graph(tmp_path):
    import autoq
    from autoq.ir.graph import prepare

    torch, net = torch_cnn()
    x = torch.randn(1, 3, 16, 16)
    mt, pt = autoq.from_torch(net, (x,))
    torch.onnx.export(net, (x,), str(tmp_path / "net.onnx"), opset_version=13, dynamo=False)
    mo, po = autoq.from_onnx(tmp_path / "net.onnx")
    gt, go = prepare(mt, pt), prepare(mo, po)
    tvm.ir.assert_structural_equal(gt.module["main"], go.module["main"], map_free_vars=True)
    # and the weights are the same arrays under the same names
    assert sorted(pt) == sorted(po)
    for k in pt:
        np.testing.assert_allclose(np.asarray(pt[k]), np.asarray(po[k]), rtol=1e-6, atol=1e-7)


def _ffn(w, b, out_shape=(1, 4, 6), r_shape=(1, 4, 6), leak=False, before=True):
    """``reshape(x @ w + b, out_shape) + r`` (``before``: as written; else the canonical
    ``reshape(x @ w + b + reshape(r), out_shape)``); ``leak``: the dense output is also an
    output of the function."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 8], F32))
    r = relax.Var("r", relax.TensorType(list(r_shape), F32))
    with bb.function("main", [x, r]):
        with bb.dataflow():
            dense = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, c(w))), c(b)))
            if before:
                out = relax.op.add(bb.emit(relax.op.reshape(dense, out_shape)), r)
            else:
                summed = bb.emit(relax.op.add(dense, bb.emit(relax.op.reshape(r, (4, 6)))))
                out = relax.op.reshape(summed, out_shape)
            gv = bb.emit_output(relax.Tuple([out, dense]) if leak else out)
        bb.emit_func_output(gv)
    return bb.get()


def test_a_residual_after_the_reshape_of_a_dense_output_moves_before_it():
    """A transformer's FFN output ``reshape(x @ W + b) + r`` (tokens as rows) becomes
    ``reshape(x @ W + b + reshape(r))``: the same float32 sums (bit-identical, and equal to
    numpy's), the residual now the dense layer's. Left alone: a reshape that changes the
    last axis, a residual that broadcasts, a dense output read elsewhere."""
    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(8, 6)).astype(F32), rng.normal(size=6).astype(F32)
    before = _ffn(w, b)
    tvm.ir.assert_structural_equal(
        canonicalize(before)["main"], _ffn(w, b, before=False)["main"], map_free_vars=True
    )
    x, r = rng.normal(size=(4, 8)).astype(F32), rng.normal(size=(1, 4, 6)).astype(F32)

    def run2(mod):
        ex = tvm.compile(mod, TARGET)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(r)).numpy()

    got = run2(canonicalize(before))
    np.testing.assert_allclose(got, (x @ w + b).reshape(1, 4, 6) + r, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got, run2(before))
    for kept in (
        _ffn(w, b, out_shape=(1, 6, 4), r_shape=(1, 6, 4)),
        _ffn(w, b, r_shape=(1, 1, 6)),
        _ffn(w, b, leak=True),
    ):
        tvm.ir.assert_structural_equal(
            canonicalize(kept)["main"], relax.transform.Normalize()(kept)["main"]
        )
