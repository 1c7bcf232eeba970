"""autoq.cpu blocked activations (NCHW[x]c between packed int8 convs): bit for bit against
the NCHW kernel lowering, the generic lowering and a numpy reference, on the VNNI path (skipped
with the reason on CPUs without AVX-512 VNNI) and the AVX2 path ("haswell" target, any AVX2
CPU); which tensors flow blocked (conv -> conv) and which stay NCHW edges (model outputs,
residual adds, convs that disagree); that the consumer's pack stage is gone; and that on AMX
targets the convs around depthwise ones stay on VNNI (autoq.cpu.depthwise_neighbours)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tvm
from test_cpu_epilogue import TARGETS as EPILOGUE_TARGETS
from tvm import relax

import autoq
from autoq import qnn
from autoq.cpu import blocked
from autoq.cpu.depthwise_neighbours import depthwise_neighbours, weight_key
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.ir.toolkit import bindings, is_call, shape_of

TARGETS = [p for p in EPILOGUE_TARGETS if p.id != "amx"]  # AVX2 and VNNI
# out channels, kernel, stride, padding, depthwise of each conv of the chain
CHAIN = [
    (20, 3, 1, (1, 1, 1, 1), False),  # NCHW in (model input), blocked out
    (24, 1, 1, (0, 0, 0, 0), False),  # blocked in read directly (no padding), blocked out
    (16, 3, 2, (1, 0, 1, 1), False),  # blocked in, padded by the consumer; asymmetric padding
    (8, 1, 2, (0, 0, 0, 0), False),  # strided 1x1 with a blocked input; model output: NCHW
]
# pointwise -> depthwise (channel-blocked kernel: narrow planes, 5x5) -> pointwise
DEPTHWISE_CHAIN = [
    (24, 1, 1, (0, 0, 0, 0), False),
    (24, 3, 1, (1, 1, 1, 1), True),
    (24, 5, 2, (2, 2, 2, 2), True),
    (16, 1, 1, (0, 0, 0, 0), False),
]
# pointwise -> wide 3x3 depthwise (stride 1, then 2: blocked between the pointwise convs) ->
# pointwise; 40 channels: 3 (VNNI) / 5 (AVX2) channel blocks, each packs its own plane
# (depthwise.PLANE_PACK_MIN_BLOCKS; the 24 channels above: 2 blocks on VNNI, one pack pass)
WIDE_DEPTHWISE_CHAIN = [
    (40, 1, 1, (0, 0, 0, 0), False),
    (40, 3, 1, (1, 1, 1, 1), True),
    (40, 3, 2, (1, 1, 1, 1), True),
    (16, 1, 1, (0, 0, 0, 0), False),
]
# 3x3 convs storing the blocked layout with 16 / 8 output channels, 12 columns: the AVX2
# CONV_BLOCKINGS row's 6 x 1 tiles (autoq.cpu.conv2d), then a 1x1 to the NCHW output
WIDE_3X3_CHAIN = [
    (16, 3, 1, (1, 1, 1, 1), False),
    (8, 3, 1, (1, 1, 1, 1), False),
    (8, 1, 1, (0, 0, 0, 0), False),
]
X_SHAPE = (1, 12, 11, 12)
WIDE_SHAPE = (1, 12, 5, 70)
_RANGE = {"int8": (-128, 128), "uint8": (0, 256)}


def _conv(bb, x, rng, layer, z_in, z_out, out_dtype="int8", rounding="float", bare=False):
    """requantize(conv(x) + bias) with per-channel scales (``bare``: the int32 conv(x))."""
    oc, k, s, pad, depthwise = layer
    ic = 1 if depthwise else shape_of(x)[1]
    w_np = rng.integers(-128, 128, (oc, ic, k, k)).astype(np.int8)
    w = relax.const(w_np)
    qx = [relax.const(np.float32(0.02)), relax.const(np.asarray(z_in, np.int32))]
    qw = [relax.const(np.full(oc, 0.01, np.float32)), relax.const(np.zeros(oc, np.int32))]
    groups = oc if depthwise else 1
    acc = bb.emit(qnn.conv2d(x, w, *qx, *qw, (s, s), pad, groups=groups))
    if bare:
        return acc, (w_np, None, None, z_in, None)
    b = rng.integers(-3000, 3000, (1, oc, 1, 1)).astype(np.int32)
    acc = bb.emit(relax.op.add(acc, relax.const(b)))
    s_np = rng.uniform(1e-4, 3e-4, oc).astype(np.float32)
    s_in = relax.const(s_np)
    req = qnn.requantize(
        acc, s_in, relax.const(np.zeros(oc, np.int32)), relax.const(np.float32(0.05)),
        relax.const(np.asarray(z_out, np.int32)), axis=1, out_dtype=out_dtype, rounding=rounding,
    )  # fmt: skip
    return bb.emit(req), (w_np, b, s_np, z_in, z_out)


def _chain_module(
    dtype="int8", rounding="float", residual=False, seed=0, chain=None, shape=None, lut=False,
    bare=False, per_channel=False,
):  # fmt: skip
    """main(x) = the ``chain`` of convs (default CHAIN; int8 or uint8 activations, zero
    points -3 / 7 / ...); ``residual``: the second conv's output also feeds an ``add``;
    ``lut``: a random ``qnn.lut`` (an activation) after each conv but the last; ``bare``: the
    last conv returns its int32 accumulator (no bias, no requantize); ``per_channel``: the
    depthwise convs' inputs have one zero point per channel (and so has the requantize
    before them) and the lookups one table per channel (PP-OCRv4 det's backbone)."""
    chain, shape = chain or CHAIN, shape or X_SHAPE
    rng = np.random.default_rng(seed)
    x = relax.Var("x", relax.TensorType(shape, dtype))
    zs = [-3, 7, -20, 0, 4] if dtype == "int8" else [130, 3, 200, 128, 90]
    if per_channel:
        lo, hi = (-20, 20) if dtype == "int8" else (100, 160)
        zs = [rng.integers(lo, hi, c[0]) if c[4] else z for c, z in zip(chain, zs, strict=False)]
        zs += [4 if dtype == "int8" else 90] * (len(chain) + 1 - len(zs))
    bb = relax.BlockBuilder()
    layers = []
    with bb.function("main", [x]):
        with bb.dataflow():
            h = x
            for i, layer in enumerate(chain):
                last = bare and i == len(chain) - 1
                h, params = _conv(bb, h, rng, layer, zs[i], zs[i + 1], dtype, rounding, last)
                table = None
                if lut and i < len(chain) - 1:
                    rows = (layer[0], 256) if per_channel else (256,)
                    table = rng.integers(*_RANGE[dtype], rows).astype(dtype)
                    axis = 1 if per_channel else None
                    h = bb.emit(qnn.lut(h, relax.const(table), axis=axis))
                layers.append((layer, params, table))
                if residual and i == 1:
                    side = bb.emit(relax.op.add(h, h))
            out = bb.emit_output(relax.Tuple([h, side]) if residual else h)
        bb.emit_func_output(out)
    return tvm.IRModule({"main": bb.get()["main"]}), layers


def _reference(x: np.ndarray, layers, dtype: str) -> np.ndarray:
    """numpy: float-rounding requantize of conv(x - z_in, w) + bias, layer by layer."""
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    h = x
    for (_, k, s, (pt, pl, pb, pr), depthwise), (w, b, s_in, z_in, z_out), table in layers:
        z_in = np.reshape(z_in, (1, -1, 1, 1))
        xc = np.pad(h.astype(np.int64) - z_in, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
        oh, ow = (xc.shape[2] - k) // s + 1, (xc.shape[3] - k) // s + 1
        acc = np.zeros((h.shape[0], w.shape[0], oh, ow), np.int64)
        for i in range(k):
            for j in range(k):
                patch = xc[:, :, i : i + s * (oh - 1) + 1 : s, j : j + s * (ow - 1) + 1 : s]
                wij = w[:, :, i, j].astype(np.int64)
                if depthwise:
                    acc += patch * wij.reshape(1, -1, 1, 1)
                else:
                    acc += np.einsum("nchw,oc->nohw", patch, wij)
        if b is None:
            return acc.astype(np.int32)
        acc = (acc + b).astype(np.int32)
        real = acc.astype(np.float32) * s_in.reshape(1, -1, 1, 1)
        q = np.round(real / np.float32(0.05)) + np.reshape(z_out, (1, -1, 1, 1))
        h = np.clip(q, lo, hi).astype(dtype)
        if table is not None and table.ndim == 2:  # one table per channel
            h = table[np.arange(len(table)).reshape(1, -1, 1, 1), h.astype(np.int32) - lo]
        elif table is not None:
            h = table[h.astype(np.int32) - lo]
    return h


def _assert_blocked_exact(mod, target, x, layers) -> None:
    """The blocked build of an int8 chain equals the generic lowering and numpy, bit for bit."""
    got = _run(mod, target, x, blocked_layout=True)[0]
    np.testing.assert_array_equal(got, _run(mod, target, x, cpu_kernels=False)[0])
    np.testing.assert_array_equal(got, _reference(x, layers, "int8"))


def _run(mod, target, x, **options):
    ex = autoq.compile(mod, target, **options)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out] if isinstance(out, tvm.ir.Array) else [out.numpy()]


def _kernel_names(mod, target, on: bool) -> list[str]:
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target), blocked_layout=on)
    return sorted(gv.name_hint for gv in lowered.functions if gv.name_hint.startswith("autoq"))


def _packs(mod, target, on: bool) -> int:
    """How many conv kernels of the lowered module have a pack stage."""
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target), blocked_layout=on)
    return sum(
        "autoq_pack" in func.script()
        for gv, func in lowered.functions_items()
        if gv.name_hint.startswith("autoq_conv2d")
    )


def _blocked_reads(mod, target, on: bool | None = True) -> int:
    """How many conv / depthwise kernel calls of the lowered module read a blocked (5-D)
    tensor."""
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target), blocked_layout=on)
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    kernels = ("autoq_conv2d", "autoq_depthwise")
    return sum(
        c.args[0].name_hint.startswith(kernels) and len(shape_of(c.args[1][0])) == 5 for c in calls
    )


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("dtype", "rounding"), [("int8", "float"), ("uint8", "tflite")])
@pytest.mark.parametrize(
    ("chain", "lut", "shape"),
    [
        (CHAIN, False, X_SHAPE),
        (WIDE_3X3_CHAIN, False, X_SHAPE),
        (DEPTHWISE_CHAIN, False, X_SHAPE),
        (DEPTHWISE_CHAIN, True, X_SHAPE),
        (WIDE_DEPTHWISE_CHAIN, False, WIDE_SHAPE),
    ],
    ids=["convs", "3x3-row", "depthwise", "depthwise-lut", "depthwise-wide"],
)
def test_blocked_chain_bit_exact(target, dtype, rounding, chain, lut, shape):
    mod, layers = _chain_module(dtype, rounding, chain=chain, shape=shape, lut=lut)
    _assert_chain_exact(mod, layers, target, dtype, rounding, shape)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize(
    ("chain", "shape"),
    [
        (DEPTHWISE_CHAIN, X_SHAPE),
        (WIDE_DEPTHWISE_CHAIN, WIDE_SHAPE),
        (WIDE_DEPTHWISE_CHAIN, (1, 12, 9, 64)),
    ],
    ids=["narrow", "wide", "wide-64-pixel-groups"],
)
def test_per_channel_chain_bit_exact(target, dtype, chain, shape):
    """Per-channel depthwise zero points and per-channel lookups: everything flows blocked on
    VNNI (the lookups too), the depthwise convs read blocked on AVX2 (the lookups are edges);
    the same bits as the NCHW and generic lowerings and numpy."""
    mod, layers = _chain_module(dtype, chain=chain, shape=shape, lut=True, per_channel=True)
    vnni = tvm.target.codegen.target_has_features("avx512vnni", tvm.target.Target(target))
    assert _blocked_reads(mod, target) == (3 if vnni else 0)
    no_lut, _ = _chain_module(dtype, chain=chain, shape=shape, per_channel=True)
    assert _blocked_reads(no_lut, target) == 3
    _assert_chain_exact(mod, layers, target, dtype, "float", shape)


def _assert_chain_exact(mod, layers, target, dtype, rounding, shape):
    rng = np.random.default_rng(1)
    lo, hi = (-128, 128) if dtype == "int8" else (0, 256)
    x = rng.integers(lo, hi, shape).astype(dtype)
    got = _run(mod, target, x, blocked_layout=True)
    nchw = _run(mod, target, x, blocked_layout=False)
    generic = _run(mod, target, x, cpu_kernels=False)
    np.testing.assert_array_equal(got[0], nchw[0])
    np.testing.assert_array_equal(got[0], generic[0])
    if rounding == "float":
        np.testing.assert_array_equal(got[0], _reference(x, layers, dtype))


@pytest.mark.parametrize("target", TARGETS)
def test_pack_gone_between_consecutive_convs(target):
    """Before (NCHW): every conv kernel packs its input. After: only the first (model input)
    and the padded consumer (a pad of the blocked tensor, no transpose) keep a pack stage."""
    mod, _ = _chain_module()
    assert _packs(mod, target, on=False) == 4
    assert _packs(mod, target, on=True) == 2
    assert _blocked_reads(mod, target) == 3
    assert sum("blocked" in n for n in _kernel_names(mod, target, on=True)) == 4
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target), blocked_layout=True)
    assert shape_of(lowered["main"].body.body) == (1, CHAIN[-1][0], 3, 3)  # NCHW output


@pytest.mark.parametrize("target", TARGETS)
def test_residual_add_is_an_edge(target):
    """The second conv's output also feeds an add: it stays NCHW (the others flow blocked)."""
    mod, _ = _chain_module(residual=True)
    assert _blocked_reads(mod, target) == 2  # the third conv reads NCHW
    x = np.random.default_rng(3).integers(-128, 128, X_SHAPE).astype("int8")
    got = _run(mod, target, x, blocked_layout=True)
    generic = _run(mod, target, x, cpu_kernels=False)
    for a, b in zip(got, generic, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("target", TARGETS)
def test_depthwise_chain_structure(target):
    """Narrow planes and wide 3x3 planes alike: the pointwise -> depthwise -> depthwise ->
    pointwise tensors all flow blocked (the depthwise convs run the channel-blocked kernel);
    a wide 3x3 depthwise reading the model input and writing the model output (NCHW on both
    sides) runs the row kernel."""
    assert _blocked_reads(_chain_module(chain=DEPTHWISE_CHAIN)[0], target) == 3
    wide, _ = _chain_module(chain=WIDE_DEPTHWISE_CHAIN, shape=WIDE_SHAPE)
    assert _blocked_reads(wide, target) == 3
    assert sum("depthwise_blocked" in n for n in _kernel_names(wide, target, on=True)) == 2
    alone, _ = _chain_module(chain=WIDE_DEPTHWISE_CHAIN[1:2], shape=(1, 40, 5, 70))
    assert _blocked_reads(alone, target) == 0
    assert _kernel_names(alone, target, on=True) == ["autoq_depthwise"]
    x = np.random.default_rng(4).integers(-128, 128, (1, 40, 5, 70)).astype("int8")
    np.testing.assert_array_equal(
        _run(alone, target, x, blocked_layout=True)[0],
        _run(alone, target, x, cpu_kernels=False)[0],
    )


@pytest.mark.parametrize("target", TARGETS)
def test_lookups_between_convs(target):
    """conv -> qnn.lut -> conv: on VNNI the lookup reads the blocked bytes as its table index
    (everything flows blocked); on AVX2 (int16 blocks) the lookups are edges."""
    mod, _ = _chain_module(chain=DEPTHWISE_CHAIN, lut=True)
    vnni = tvm.target.codegen.target_has_features("avx512vnni", tvm.target.Target(target))
    assert _blocked_reads(mod, target) == (3 if vnni else 0)


@pytest.mark.parametrize("target", TARGETS)
def test_bare_conv_reads_blocked(target):
    """A conv whose int32 output is not requantized by itself (ResNet's last conv of a block
    goes into the residual add) still reads its blocked input."""
    mod, layers = _chain_module(bare=True)
    assert _blocked_reads(mod, target) == 3
    x = np.random.default_rng(5).integers(-128, 128, X_SHAPE).astype("int8")
    _assert_blocked_exact(mod, target, x, layers)


@pytest.mark.parametrize("target", TARGETS)
def test_batch_of_two(target):
    shape = (2, *X_SHAPE[1:])
    mod, layers = _chain_module(shape=shape)
    x = np.random.default_rng(6).integers(-128, 128, shape).astype("int8")
    _assert_blocked_exact(mod, target, x, layers)


@pytest.mark.parametrize("target", TARGETS)
def test_default_comes_from_the_target(target):
    """Default: blocked on VNNI and AVX2 targets (both measured faster with the residual
    epilogue)."""
    mod, _ = _chain_module()
    assert _blocked_reads(mod, target, on=None) == 3
    assert _blocked_reads(mod, target, on=False) == 0


def test_layout_validation_and_json():
    with pytest.raises(ValueError, match="block must be a power of two"):
        blocked.BlockedLayout(12, "uint8", 0)
    with pytest.raises(ValueError, match="dtype"):
        blocked.BlockedLayout(16, "float32", 0)


def test_doctests():
    assert doctest.testmod(blocked).failed == 0


AMX_TARGETS = [p for p in EPILOGUE_TARGETS if p.id == "amx"]
# pointwise (feeds the depthwise conv) -> depthwise -> pointwise (reads it) -> pointwise (reads
# a pointwise conv: neither); 64+ channels, so that AMX accepts every pointwise conv
AMX_DEPTHWISE_CHAIN = [
    (96, 1, 1, (0, 0, 0, 0), False),
    (96, 3, 1, (1, 1, 1, 1), True),
    (64, 1, 1, (0, 0, 0, 0), False),
    (64, 1, 1, (0, 0, 0, 0), False),
]
AMX_SHAPE = (1, 64, 6, 10)


@pytest.mark.parametrize("lut", [False, True], ids=["requantize", "requantize-lut"])
def test_depthwise_neighbours_are_the_convs_around_depthwise(lut):
    """autoq.cpu.depthwise_neighbours: the convs reading a depthwise conv's output or
    feeding its input (through a bias add, a requantize, a lookup), no other."""
    mod, layers = _chain_module(chain=AMX_DEPTHWISE_CHAIN, shape=AMX_SHAPE, lut=lut)
    keys = [weight_key(params[0]) for _, params, _ in layers]
    assert depthwise_neighbours(mod) == {keys[0], keys[2]}
    plain, _ = _chain_module(
        chain=[AMX_DEPTHWISE_CHAIN[0], AMX_DEPTHWISE_CHAIN[2]], shape=AMX_SHAPE
    )
    assert depthwise_neighbours(plain) == frozenset()


def _conv_kernels(mod, target) -> list[str]:
    """The kernel each conv call of the lowered module runs, in order."""
    lowered = lower_to_cpu_kernels(mod, tvm.target.Target(target))
    calls = [e for _, e in bindings(lowered["main"]) if is_call(e, "relax.call_tir")]
    names = [c.args[0].name_hint for c in calls]
    return [n for n in names if n.startswith(("autoq_conv2d", "autoq_depthwise"))]


@pytest.mark.parametrize("target", AMX_TARGETS)
def test_amx_keeps_depthwise_neighbours_on_vnni_bit_exact(target):
    """On AMX the depthwise conv's neighbours (a lookup after each) run the VNNI kernel (the
    chain flows blocked), the conv after them stays on AMX; the bits of the generic lowering
    and numpy."""
    mod, layers = _chain_module(chain=AMX_DEPTHWISE_CHAIN, shape=AMX_SHAPE, lut=True)
    kinds = _conv_kernels(mod, target)
    assert [k.startswith("autoq_conv2d_vnni_blocked") for k in kinds] == [1, 0, 1, 0]
    assert kinds[1].startswith("autoq_depthwise_blocked")
    assert kinds[3].startswith("autoq_conv2d_amx")
    x = np.random.default_rng(1).integers(-128, 128, AMX_SHAPE).astype(np.int8)
    got = _run(mod, target, x)[0]
    np.testing.assert_array_equal(got, _run(mod, target, x, cpu_kernels=False)[0])
    np.testing.assert_array_equal(got, _reference(x, layers, "int8"))
