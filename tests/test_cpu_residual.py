"""autoq.cpu residual epilogues (the residual add + requantize of a conv in its kernel, the
shortcut read in NCHW or in the blocked layout): bit for bit against the unfused blocked
build, the NCHW kernel lowering, the generic lowering and a numpy reference, on the VNNI path
(skipped with the reason on CPUs without AVX-512 VNNI) and the AVX2 path ("haswell" target,
blocked layout forced on); which tensors flow blocked before and after (no pack between
blocks)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from test_cpu_amx import AMX_TARGET, needs_amx
from test_cpu_blocked import TARGETS
from tvm import relax

import autoq
from autoq import qnn
from autoq.cpu import blocked_elementwise, residual
from autoq.cpu.epilogue import Epilogue
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.ir.toolkit import bindings, is_call, shape_of

X_SHAPE = (2, 16, 9, 10)  # batch 2
_LIMITS = {"int8": (-128, 127), "uint8": (0, 255)}
_ZEROS = {
    "int8": [-3, 5, -128, 2, -7, -128, 9, -128, 1],
    "uint8": [130, 3, 0, 128, 90, 0, 7, 0, 60],
}
# one entry per conv: out channels, kernel, stride, padding
_LAYERS = {
    "a1": (16, 1, 1, 0),  # block A: identity shortcut = the model input (an NCHW edge)
    "a2": (16, 3, 1, 1),
    "a3": (16, 1, 1, 0),
    "ds": (32, 1, 2, 0),  # block B: downsample branch (read only by the residual add)
    "b1": (24, 3, 2, 1),
    "b2": (32, 1, 1, 0),
    "c1": (32, 3, 1, 1),  # block C: identity shortcut from a blocked producer, no bias
    "c2": (32, 1, 1, 0),
    "head": (8, 1, 1, 0),  # model output: NCHW
    "p3": (64, 3, 1, 1),  # AMX: 3x3 with 64 channels, its shortcut the NCHW model input
    "n1": (40, 1, 1, 0),  # AMX 1x1 -> NCHW
    "v3": (40, 3, 1, 1),  # VNNI (40 channels): blocked out, read by v3b and r1's shortcut
    "v3b": (32, 3, 1, 1),  # VNNI, reads v3 blocked; NCHW out (r1 is AMX)
    "r1": (40, 1, 1, 0),  # AMX 1x1 with the blocked shortcut of v3
}


class _Net:
    """Builds the qnn module and, layer by layer, its numpy reference (float rounding)."""

    def __init__(self, dtype: str, rounding: str, seed: int = 0):
        self.dtype, self.rounding = dtype, rounding
        self.rng = np.random.default_rng(seed)
        self.bb = relax.BlockBuilder()
        self.zeros = iter(_ZEROS[dtype])
        self.ops = []  # numpy reference steps

    def conv(self, x, z_in, name, bias=True):
        oc, k, s, p = _LAYERS[name]
        w = self.rng.integers(-128, 128, (oc, shape_of(x)[1], k, k)).astype(np.int8)
        s_w = self.rng.uniform(0.005, 0.02, oc).astype(np.float32)
        qx = [relax.const(np.float32(0.02)), relax.const(np.int32(z_in))]
        qw = [relax.const(s_w), relax.const(np.zeros(oc, np.int32))]
        acc = self.bb.emit(qnn.conv2d(x, relax.const(w), *qx, *qw, (s, s), (p,) * 4))
        b = None
        if bias:
            b = self.rng.integers(-3000, 3000, (1, oc, 1, 1)).astype(np.int32)
            acc = self.bb.emit(relax.op.add(acc, relax.const(b)))
        return acc, (w, b, z_in, s, p, np.float32(0.02) * s_w)

    def requantize(self, acc, s_acc, z_out):
        req = qnn.requantize(
            acc, relax.const(s_acc), relax.const(np.zeros(s_acc.size, np.int32)),
            relax.const(np.float32(0.05)), relax.const(np.int32(z_out)),
            axis=1, out_dtype=self.dtype, rounding=self.rounding,
        )  # fmt: skip
        return self.bb.emit(req)

    def layer(self, x, z_in, name, shortcut=None, bias=True):
        """requantize(conv(x) + bias [+ requantize(shortcut) -> int32]) -> int8/uint8."""
        acc, params = self.conv(x, z_in, name, bias)
        s_acc = params[5]
        if shortcut is not None:
            short, z_short = shortcut
            r = qnn.requantize(
                short, relax.const(np.float32(0.05)), relax.const(np.int32(z_short)),
                relax.const(s_acc), relax.const(np.zeros(s_acc.size, np.int32)),
                axis=1, out_dtype="int32", rounding=self.rounding,
            )  # fmt: skip
            acc = self.bb.emit(relax.op.add(acc, self.bb.emit(r)))
        z_out = next(self.zeros)
        out = self.requantize(acc, s_acc, z_out)
        self.ops.append((out, x, name, params, shortcut, z_out))
        return out, z_out


def _module(dtype="int8", rounding="float", shape=X_SHAPE, seed=0):
    """main(x): block A (identity), block B (downsample), block C (identity, no bias), head."""
    net = _Net(dtype, rounding, seed)
    x = relax.Var("x", relax.TensorType(shape, dtype))
    z0 = next(net.zeros)
    with net.bb.function("main", [x]):
        with net.bb.dataflow():
            h, z = net.layer(x, z0, "a1")
            y, zy = net.layer(h, z, "a2", shortcut=(x, z0))
            d, zd = net.layer(y, zy, "ds")
            h, z = net.layer(y, zy, "b1")
            y, zy = net.layer(h, z, "b2", shortcut=(d, zd))
            h, z = net.layer(y, zy, "c1")
            y, zy = net.layer(h, z, "c2", shortcut=(y, zy), bias=False)
            out, _ = net.layer(y, zy, "head")
            gv = net.bb.emit_output(out)
        net.bb.emit_func_output(gv)
    return tvm.IRModule({"main": net.bb.get()["main"]}), net


def _conv_acc(x, w, z_in, s, p):
    xc = np.pad(x.astype(np.int64) - z_in, ((0, 0), (0, 0), (p, p), (p, p)))
    k = w.shape[2]
    oh, ow = (xc.shape[2] - k) // s + 1, (xc.shape[3] - k) // s + 1
    acc = np.zeros((x.shape[0], w.shape[0], oh, ow), np.int64)
    for i in range(k):
        for j in range(k):
            patch = xc[:, :, i : i + s * (oh - 1) + 1 : s, j : j + s * (ow - 1) + 1 : s]
            acc += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j].astype(np.int64))
    return acc


def _reference(x: np.ndarray, net: _Net) -> np.ndarray:
    """numpy, float rounding: conv + bias + the shortcut requantized to the accumulator's
    grid (float32 math, int32 result), requantized to the layer's zero point (0.05)."""
    lo, hi = _LIMITS[net.dtype]
    values = [(net.ops[0][1], x)]  # (variable, value), from the model input on

    def get(var):
        return next(v for k, v in values if k.same_as(var))

    for out, data, _, (w, b, z_in, s, p, s_acc), shortcut, z_out in net.ops:
        acc = _conv_acc(get(data), w, z_in, s, p)
        if b is not None:
            acc = acc + b
        acc = acc.astype(np.int32)
        s_c = s_acc.reshape(1, -1, 1, 1)
        if shortcut is not None:
            short, z_short = shortcut
            real = (get(short).astype(np.int32) - z_short).astype(np.float32) * np.float32(0.05)
            acc = acc + np.clip(np.round(real / s_c), -(2**31), 2**31 - 1).astype(np.int32)
        q = np.round(acc.astype(np.float32) * s_c / np.float32(0.05)) + z_out
        values.append((out, np.clip(q, lo, hi).astype(net.dtype)))
    return values[-1][1]


def _run(mod, target, x, **options):
    ex = autoq.compile(mod, target, **options)
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _structure(mod, target, residual_on: bool) -> dict[str, int]:
    """Conv kernel calls, those reading a blocked (5-D) tensor, conv kernels with a pack
    stage, residual kernels, and the other (elementwise) calls, blocked layout on."""
    lowered = lower_to_cpu_kernels(
        mod, tvm.target.Target(target), blocked_layout=True, residual_epilogue=residual_on
    )
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    convs = [c for c in calls if c.args[0].name_hint.startswith("autoq_conv2d")]
    return {
        "convs": len(convs),
        "read blocked": sum(len(shape_of(c.args[1][0])) == 5 for c in convs),
        "pack": sum("autoq_pack" in lowered[c.args[0]].script(show_meta=False) for c in convs),
        "residual": sum("residual" in c.args[0].name_hint for c in convs),
        "other": len(calls) - len(convs),
    }


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    ("dtype", "rounding"), [("int8", "float"), ("uint8", "float"), ("uint8", "tflite")]
)
def test_residual_blocks_bit_exact(target, dtype, rounding):
    mod, net = _module(dtype, rounding)
    lo, hi = _LIMITS[dtype]
    x = np.random.default_rng(1).integers(lo, hi + 1, X_SHAPE).astype(dtype)
    got = _run(mod, target, x, blocked_layout=True, residual_epilogue=True)
    np.testing.assert_array_equal(got, _run(mod, target, x, cpu_kernels=False))
    np.testing.assert_array_equal(got, _run(mod, target, x, blocked_layout=False))
    np.testing.assert_array_equal(
        got, _run(mod, target, x, blocked_layout=False, residual_epilogue=True)
    )
    if rounding == "float":
        np.testing.assert_array_equal(got, _reference(x, net))


@pytest.mark.parametrize("target", TARGETS)
def test_blocked_between_blocks(target):
    """Before: each residual add is an NCHW edge (its conv returns int32 NCHW, the add and
    requantizes run elementwise, the next block's convs pack again). After: the residual
    convs store the next block's blocked layout; only the first conv (model input) packs
    from NCHW (the 3x3 convs pad their blocked input), and nothing runs between the
    kernels."""
    mod, _ = _module()
    before, after = _structure(mod, target, False), _structure(mod, target, True)
    # packs before: a1, a2 (pad), ds, b1, c1, head; after: a1 (NCHW input), the 3x3 pads
    # a2, b1, c1. Before, each block's bias add, shortcut requantize, residual add and
    # requantize run between the kernels (block C has no bias: 4 + 4 + 3)
    assert before == {"convs": 8, "read blocked": 3, "pack": 6, "residual": 0, "other": 11}
    assert after == {"convs": 8, "read blocked": 7, "pack": 4, "residual": 3, "other": 0}


@pytest.mark.parametrize("target", TARGETS)
def test_shortcut_with_another_user_stays_nchw(target):
    """The block input is also a model output: it stays NCHW and the residual kernel reads
    its shortcut NCHW (the rest still flows blocked)."""
    net = _Net("int8", "float")
    x = relax.Var("x", relax.TensorType(X_SHAPE, "int8"))
    z0 = next(net.zeros)
    with net.bb.function("main", [x]):
        with net.bb.dataflow():
            y, zy = net.layer(x, z0, "a1")
            h, z = net.layer(y, zy, "a2")
            y2, _ = net.layer(h, z, "a3", shortcut=(y, zy))
            gv = net.bb.emit_output(relax.Tuple([y2, y]))
        net.bb.emit_func_output(gv)
    mod = tvm.IRModule({"main": net.bb.get()["main"]})
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target), True, True)
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    res = [c for c in calls if "residual" in c.args[0].name_hint]
    # arguments: data, weights[, compensation], shortcut, its table, the epilogue table
    assert len(res) == 1 and len(shape_of(res[0].args[1][-3])) == 4
    xs = np.random.default_rng(2).integers(-128, 128, X_SHAPE).astype("int8")
    ex = autoq.compile(mod, target, blocked_layout=True, residual_epilogue=True)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(xs))
    ref = relax.VirtualMachine(autoq.compile(mod, target, cpu_kernels=False), tvm.cpu())["main"](
        tvm.runtime.tensor(xs)
    )
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("target", TARGETS)
def test_default_follows_the_blocked_layout(target):
    """residual_epilogue=None: on where the blocked layout is (by default on VNNI and AVX2),
    off otherwise; it also applies to the NCHW lowering when asked for."""
    mod, _ = _module()
    t = tvm.target.Target(target)

    def residual_kernels(**options):
        lowered = lower_to_cpu_kernels(mod, t, **options)
        return sum("residual" in gv.name_hint for gv in lowered.functions)

    assert residual_kernels() == 3
    assert residual_kernels(blocked_layout=True) == 3
    assert residual_kernels(blocked_layout=False) == 0
    assert residual_kernels(blocked_layout=False, residual_epilogue=True) == 3


@pytest.mark.parametrize("target", TARGETS)
def test_depthwise_residual_stays_unfused(target):
    """A residual on a depthwise conv (no residual epilogue in that kernel) keeps its NCHW
    add chain, and its shortcut (the first conv's output) stays NCHW; still exact."""
    rng = np.random.default_rng(7)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(X_SHAPE, "int8"))
    s_acc = np.full(16, 0.02 * 0.01, np.float32)
    with bb.function("main", [x]):
        with bb.dataflow():
            net = _Net("int8", "float")
            net.bb = bb
            h, z = net.layer(x, -3, "a1")
            w = relax.const(rng.integers(-128, 128, (16, 1, 3, 3)).astype(np.int8))
            q = [relax.const(np.float32(0.02)), relax.const(np.int32(z))]
            qw = [relax.const(np.full(16, 0.01, np.float32)), relax.const(np.zeros(16, np.int32))]
            acc = bb.emit(qnn.conv2d(h, w, *q, *qw, (1, 1), (1, 1, 1, 1), groups=16))
            r = qnn.requantize(
                h, relax.const(np.float32(0.05)), relax.const(np.int32(z)),
                relax.const(s_acc), relax.const(np.zeros(16, np.int32)),
                axis=1, out_dtype="int32",
            )  # fmt: skip
            acc = bb.emit(relax.op.add(acc, bb.emit(r)))
            gv = bb.emit_output(net.requantize(acc, s_acc, -128))
        bb.emit_func_output(gv)
    mod = tvm.IRModule({"main": bb.get()["main"]})
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target), True, True)
    assert not any("residual" in gv.name_hint for gv in lowered.functions)
    xs = np.random.default_rng(8).integers(-128, 128, X_SHAPE).astype("int8")
    got = _run(mod, target, xs, blocked_layout=True, residual_epilogue=True)
    np.testing.assert_array_equal(got, _run(mod, target, xs, cpu_kernels=False))


def _qnn_add(net, a, za, b, zb, z_out):
    """qnn.add of two int8 tensors (per-tensor scales 0.05), or of ``a`` and a constant."""
    q = [relax.const(np.float32(0.05)), relax.const(np.int32(za))]
    q += [relax.const(np.float32(0.05)), relax.const(np.int32(zb))]
    q += [relax.const(np.float32(0.08)), relax.const(np.int32(z_out))]
    return net.bb.emit(qnn.add(a, b, *q, out_dtype=net.dtype, rounding=net.rounding))


def _elementwise_module(dtype="int8", rounding="float"):
    """open_nsfw's downsampling block: ``qnn.add``s of two requantized conv outputs, each
    plus a per-channel int8 constant, then a per-tensor requantize (the ReLU), then a conv."""
    net = _Net(dtype, rounding)
    x = relax.Var("x", relax.TensorType(X_SHAPE, dtype))
    z0 = next(net.zeros)
    c = relax.const(net.rng.integers(-128, 128, (1, 32, 1, 1)).astype(dtype))
    with net.bb.function("main", [x]):
        with net.bb.dataflow():
            h, z = net.layer(x, z0, "a1")
            d, zd = net.layer(h, z, "ds")
            h, z = net.layer(h, z, "b1")
            h, z = net.layer(h, z, "b2")
            zc, z1, z2, z3 = (0, 3, -2, 1) if dtype == "int8" else (128, 131, 126, 129)
            h = _qnn_add(net, h, z, c, zc, z1)
            d = _qnn_add(net, d, zd, c, zc, z2)
            y = _qnn_add(net, h, z1, d, z2, z3)
            req = qnn.requantize(
                y, relax.const(np.float32(0.08)), relax.const(np.int32(z3)),
                relax.const(np.float32(0.04)), relax.const(np.int32(_LIMITS[dtype][0])),
                out_dtype=dtype, rounding=rounding,
            )  # fmt: skip
            y = net.bb.emit(req)
            out, _ = net.layer(y, _LIMITS[dtype][0], "c1")
            gv = net.bb.emit_output(out)
        net.bb.emit_func_output(gv)
    return tvm.IRModule({"main": net.bb.get()["main"]})


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("dtype", "rounding"), [("int8", "float"), ("uint8", "tflite")])
def test_plain_int8_adds_run_blocked(target, dtype, rounding):
    """The qnn.adds and the requantize run on the blocked tensors (with the per-channel
    constant re-blocked): the conv after them reads blocked too, bit for bit as before."""
    mod = _elementwise_module(dtype, rounding)
    before, after = _structure(mod, target, False), _structure(mod, target, True)
    assert (before["read blocked"], after["read blocked"]) == (3, 4)  # + the last conv
    lo, hi = _LIMITS[dtype]
    x = np.random.default_rng(3).integers(lo, hi + 1, X_SHAPE).astype(dtype)
    got = _run(mod, target, x, blocked_layout=True, residual_epilogue=True)
    np.testing.assert_array_equal(got, _run(mod, target, x, cpu_kernels=False))
    np.testing.assert_array_equal(got, _run(mod, target, x, blocked_layout=False))


def test_reblocked_constant():
    v = np.arange(20, dtype=np.int8).reshape(1, 20, 1, 1)
    got = blocked_elementwise.reblock_constant(v, 16)
    assert got[0, 1, 0, 0, 3] == 19 and got[0, 1, 0, 0, 4] == 0 and got[0, 0, 0, 0, 5] == 5


def test_residual_validation():
    short = Epilogue(None, (np.float32(0.1), 0, np.float32(0.2), 0), "float", "int32", 4)
    with pytest.raises(ValueError, match="dtype must be int8 or uint8"):
        residual.Residual(short, "int16")
    int8 = Epilogue(None, (np.float32(0.1), 0, np.float32(0.2), 0), "float", "int8", 4)
    with pytest.raises(ValueError, match="must be int32"):
        residual.Residual(int8, "int8")


def test_doctests():
    assert doctest.testmod(blocked_elementwise).failed == 0
    assert doctest.testmod(residual).failed == 0


def _amx_module(dtype: str, rounding: str):
    """Residual adds in AMX conv kernels: a padded 3x3 (output pixels over the padded
    width; the shortcut the NCHW model input) and a 1x1 whose shortcut a VNNI conv stores
    blocked (it also feeds a VNNI conv)."""
    net = _Net(dtype, rounding, seed=3)
    x = relax.Var("x", relax.TensorType(AMX_SHAPE, dtype))
    z0 = next(net.zeros)
    with net.bb.function("main", [x]):
        with net.bb.dataflow():
            y, zy = net.layer(x, z0, "p3", shortcut=(x, z0))
            h, z = net.layer(y, zy, "n1")
            g, zg = net.layer(h, z, "v3")
            k, zk = net.layer(g, zg, "v3b")
            out, _ = net.layer(k, zk, "r1", shortcut=(g, zg))
            gv = net.bb.emit_output(out)
        net.bb.emit_func_output(gv)
    return tvm.IRModule({"main": net.bb.get()["main"]}), net


AMX_SHAPE = (1, 64, 9, 10)


@needs_amx
@pytest.mark.parametrize(("dtype", "rounding"), [("int8", "float"), ("uint8", "tflite")])
def test_amx_residual_bit_exact(dtype, rounding):
    """The AMX kernels take both residual adds (a shortcut NCHW and one blocked, read as
    pixel-flattened views) and give the generic lowering's and numpy's integers."""
    mod, net = _amx_module(dtype, rounding)
    lowered = lower_to_cpu_kernels(mod, AMX_TARGET)
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    res = [c for c in calls if c.args[0].name_hint.startswith("autoq_conv2d_amx_residual")]
    # arguments: data, weights, compensation, shortcut, its table, the epilogue table
    assert sorted(len(shape_of(c.args[1][3])) for c in res) == [3, 4]
    lo, hi = _LIMITS[dtype]
    x = np.random.default_rng(4).integers(lo, hi + 1, AMX_SHAPE).astype(dtype)
    got = _run(mod, AMX_TARGET, x)
    np.testing.assert_array_equal(got, _run(mod, AMX_TARGET, x, cpu_kernels=False))
    np.testing.assert_array_equal(got, _run(mod, AMX_TARGET, x, residual_epilogue=False))
    if rounding == "float":
        np.testing.assert_array_equal(got, _reference(x, net))
