"""Per-channel depthwise inputs written by a lookup (``autoq/depthwise_channels.py``,
``Config.rules`` "depthwise_per_channel"): which slots go per channel, ``qnn.conv2d`` with a
per-channel input zero point against numpy (generic lowering and the packed depthwise
kernels, padding included), realized == simulated on conv -> hardswish -> depthwise ->
conv (both lowerings, with and without per-channel lookup inputs, GPTQ, bias
corrections), the realized depthwise stage against numpy, the option's JSON round trip and
errors, and models without such a chain unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config, QParam, QuantSpec, calibrate, realize, simulate
from autoq import primitives as P
from autoq.calibration import samples_for
from autoq.calibrators.percentile import Percentile
from autoq.config import BiasCorrection
from autoq.distributed import check_rules_in_process
from autoq.errors import InputError
from autoq.fallback.fidelity import compare, expose_slots
from autoq.ir.canonicalize import hardswish
from autoq.qnn import conv2d as qconv2d
from models import TARGET, Builder, Runner, small_cnn

SCALES = np.array([0.1, 0.5, 1.0, 2.0, 4.0, 8.0])  # very different channel ranges


def chain(width=10, kernel=3, stride=1, second_reader=False, lookup=True):
    """conv 3x3 + bias (channel c x SCALES[c]) -> hardswish -> depthwise ``kernel`` (pad
    kernel // 2, + bias) -> conv 1x1; ``second_reader``: the hardswish output is also added
    to the depthwise output (a second reader); ``lookup=False``: no hardswish (the conv
    writes the depthwise input)."""
    b = Builder(21)
    x = b.input("x", (1, 3, 6, width))
    w1 = b.rng.normal(size=(6, 3, 3, 3)) * SCALES.reshape(6, 1, 1, 1)

    def body(b):
        y = b.emit(relax.op.nn.conv2d(x, b.weight("c1.weight", w1), padding=1))
        bias = b.weight("c1.bias", b.rng.normal(size=6))
        y = b.emit(relax.op.add(y, relax.op.reshape(bias, [1, 6, 1, 1])))
        h = b.emit(hardswish(y)) if lookup else y
        wd = b.randw("dw.weight", (6, 1, kernel, kernel))
        d = b.emit(relax.op.nn.conv2d(h, wd, strides=stride, padding=kernel // 2, groups=6))
        db = b.weight("dw.bias", b.rng.normal(size=6) * 0.1)
        d = b.emit(relax.op.add(d, relax.op.reshape(db, [1, 6, 1, 1])))
        if second_reader:
            d = b.emit(relax.op.add(d, h))
        return b.emit(relax.op.nn.conv2d(d, b.randw("c3.weight", (4, 6, 1, 1))))

    mod, params = b.build(body)
    rng = np.random.default_rng(4)
    return mod, params, [rng.normal(size=(1, 3, 6, width)).astype(np.float32) for _ in range(8)]


def cfg(on=True, more=(), **kw):
    spec = QuantSpec(calibrator=Percentile(percentile=99.9))
    kw.setdefault("weight_rounding", "nearest")
    return Config(
        recipe="cnn",
        activation=spec,
        rules=(("depthwise_per_channel",) if on else ()) + tuple(more),
        **kw,
    )


HS = "autoq.hardswish_0"


def quantize(mod, params, data, config):
    sim = simulate(mod, params, config)
    qp = calibrate(sim, params, data, config, target=TARGET)
    return sim, qp, realize(mod, params, qp, config)


def _dw_layer(sim):
    return next(m.layer for m in sim.matches if m.pattern.name.startswith("conv2d") and
                int(sim.graph.value[m["core"]].attrs.groups) == 6)  # fmt: skip


def test_slots_go_per_channel_only_for_a_lookup_read_by_one_depthwise_conv():
    mod, params, _ = chain()
    on = simulate(mod, params, cfg())
    assert on.slots[HS].axis == 1
    assert [int(d) for d in on.table_vars[HS].ty.shape] == [6, 256]
    assert on.slots["c1"].axis is None  # the lookup's input stays per tensor
    both = simulate(mod, params, cfg(more=("lookup_per_channel",)))
    assert both.slots[HS].axis == 1 and both.slots["c1"].axis == 1
    assert simulate(mod, params, cfg(on=False)).slots[HS].axis is None
    mod2, params2, _ = chain(second_reader=True)  # a second reader: per tensor, no error
    assert simulate(mod2, params2, cfg()).slots[HS].axis is None
    # the lookup computed in float (16-bit output): per tensor
    assert simulate(mod, params, cfg(int16_tensors=(HS,))).slots[HS].axis is None
    # a conv writing the depthwise input: its requantize goes per channel
    mod3, params3, _ = chain(lookup=False)
    assert simulate(mod3, params3, cfg()).slots["c1"].axis == 1
    assert simulate(mod3, params3, cfg(int16_tensors=("c1",))).slots["c1"].axis is None


def numpy_depthwise(q, zx, w, pad, stride):
    """int64 ``sum (q - zx[c]) * w[c]`` with the centered input padded with 0 (real 0)."""
    x = q.astype(np.int64) - zx.reshape(1, -1, 1, 1)
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, c, h, wd = x.shape
    k = w.shape[2]
    oh, ow = (h - k) // stride + 1, (wd - k) // stride + 1
    out = np.zeros((n, c, oh, ow), np.int64)
    for i in range(k):
        for j in range(k):
            patch = x[:, :, i : i + stride * oh : stride, j : j + stride * ow : stride]
            out += patch * w[:, 0, i, j].astype(np.int64).reshape(1, c, 1, 1)
    return out


@pytest.mark.parametrize(("width", "kernel", "stride"), [(40, 3, 1), (12, 3, 1), (12, 5, 2)])
def test_qnn_conv2d_per_channel_input_matches_numpy(width, kernel, stride):
    """Row kernel (wide 3x3), channel-blocked kernel (narrow; 5x5 stride 2), generic."""
    rng = np.random.default_rng(7)
    c = 20  # not a multiple of the 16 lanes
    q = rng.integers(-128, 128, (1, c, 9, width)).astype(np.int8)
    w = rng.integers(-127, 128, (c, 1, kernel, kernel)).astype(np.int8)
    zx = rng.integers(-100, 100, c).astype(np.int32)
    pad = kernel // 2
    xv = relax.Var("x", relax.TensorType(q.shape, "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        acc = qconv2d(
            xv, relax.const(w), relax.const(np.full(c, 0.1, np.float32)), relax.const(zx),
            relax.const(np.full(c, 0.01, np.float32)), relax.const(np.zeros(c, np.int32)),
            strides=(stride, stride), padding=(pad, pad), groups=c,
        )  # fmt: skip
        bb.emit_func_output(bb.emit(acc))
    mod = bb.get()
    want = numpy_depthwise(q, zx, w, pad, stride)
    np.testing.assert_array_equal(Runner(mod)(q), want)
    lib = autoq.compile(mod, autoq.build.default_target(), cpu_kernels=True)
    got = relax.VirtualMachine(lib, tvm.cpu())["main"](tvm.runtime.tensor(q)).numpy()
    np.testing.assert_array_equal(got, want)


def test_per_channel_input_on_a_dense_conv_is_refused():
    xv = relax.Var("x", relax.TensorType((1, 4, 5, 5), "int8"))
    bb = relax.BlockBuilder()
    with pytest.raises(Exception, match=r"input_scale.*depthwise"):
        with bb.function("main", [xv]):
            acc = qconv2d(
                xv, relax.const(np.ones((4, 4, 1, 1), np.int8)),
                relax.const(np.full(4, 0.1, np.float32)), relax.const(np.zeros(4, np.int32)),
                relax.const(np.float32(0.1)), relax.const(np.int32(0)),
            )  # fmt: skip
            bb.emit_func_output(bb.emit(acc))


def _kernels(real):
    lib = autoq.compile(real, autoq.build.default_target(), cpu_kernels=True)
    vm = relax.VirtualMachine(lib, tvm.cpu())
    return lambda x: vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize(
    ("width", "kernel", "stride", "lookup", "extra"),
    [
        (40, 3, 1, True, {}),  # row kernel
        (10, 3, 1, True, {"more": ("lookup_per_channel",)}),  # blocked kernel, both halves
        (12, 5, 2, True, {"weight_rounding": "gptq", "bias_correction": BiasCorrection()}),
        (40, 3, 1, False, {"weight_rounding": "gptq"}),  # conv -> per-channel requantize
        (10, 3, 1, False, {"rounding": "half_away"}),  # integer requantize
    ],
)
def test_realized_equals_simulated_on_both_lowerings(width, kernel, stride, lookup, extra):
    mod, params, data = chain(width, kernel, stride, lookup=lookup)
    sim, qp, real = quantize(mod, params, data, cfg(**extra))
    sid = HS if lookup else "c1"
    assert qp[sid].axis == 1 and len(set(qp[sid].zero_point.tolist())) > 1
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    if extra.get("rounding", "float") == "float":
        assert rep.exact, rep.table()
    else:  # integer requantize: within one step of the simulated (float) rounding
        assert max(rep.max_lsb.values()) <= 1, rep.table()
    assert set(rep.elements) == set(sim.activation_slots())
    generic, kernels = Runner(real), _kernels(real)
    for x in data[:3]:
        np.testing.assert_array_equal(kernels(x), generic(x))


def test_realized_depthwise_stage_matches_numpy():
    """The realized depthwise output (exposed by compare's integer slots) from the
    realized lookup integers, in numpy: per-channel centered input, zero padding, int32
    bias on s_x[c] * s_w[c], per-channel requantize to the depthwise output grid."""
    mod, params, data = chain()
    sim, qp, real = quantize(mod, params, data, cfg())
    dw = _dw_layer(sim)
    exposed, order = expose_slots(real, [HS, dw], integer=True)
    run = Runner(exposed)
    hq, wq, oq = qp[HS], qp[f"{dw}.weight"], qp[dw]
    w = P.quantize(params["dw.weight"], wq.scale, wq.zero_point, "int8", 0)
    s_acc = (hq.scale * wq.scale).astype(np.float32)
    bias = P.quantize_bias(params["dw.bias"], hq.scale, wq.scale).values.reshape(1, 6, 1, 1)
    for x in data[:2]:
        outs = dict(zip(order, run(x)[1:], strict=True))
        h, d = outs[HS], outs[dw]
        acc = (numpy_depthwise(h, hq.zero_point, w, 1, 1) + bias).astype(np.int32)
        want = P.requantize(acc, s_acc, 0, oq.scale, oq.zero_point, "int8", axis=1)
        np.testing.assert_array_equal(d, want)


def test_option_json_errors_and_unchanged_models():
    c = cfg(more=("lookup_per_channel",))
    assert Config.from_json(c.to_json()) == c and "depthwise_per_channel" in c.to_json()["rules"]
    with pytest.raises(TypeError, match=r"Config.rules"):
        Config(recipe="cnn", rules=(1,))
    with pytest.raises(InputError, match=r"depthwise_per_channel.*distributed"):
        check_rules_in_process(c)
    mod, params, data = chain()
    _, qp, _ = quantize(mod, params, data, cfg())
    with pytest.raises(ValueError, match=r"hardswish.*per-axis.*depthwise_per_channel"):
        realize(mod, params, qp, cfg(on=False))
    cnn, cparams = small_cnn()[:2]
    on, off = simulate(cnn, cparams, cfg()), simulate(cnn, cparams, cfg(on=False))
    tvm.ir.assert_structural_equal(on.mod, off.mod)


def test_fallback_of_the_depthwise_conv_remaps_to_the_covering_grid():
    """AutoFallback realizes its choice with the qparams calibrated on the whole model
    (``remap_qparams``): a per-channel slot whose depthwise reader falls back to fp32 gets
    the per-tensor grid covering every channel's calibrated range (was: realize refused
    the per-axis qparams)."""
    from autoq.fallback.auto_fallback import remap_qparams

    mod, params, data = chain()
    src, qp, _ = quantize(mod, params, data, cfg(more=("lookup_per_channel",)))
    dst_cfg = cfg(more=("lookup_per_channel",), fallback=autoq.Fallback(ids=(_dw_layer(src),)))
    dst = simulate(mod, params, dst_cfg)
    assert dst.slots[HS].axis is None and dst.slots["c1"].axis == 1
    remapped = remap_qparams(src, qp, dst)
    q, old = remapped[HS], qp[HS]
    want = QParam.from_range(float(np.min(old.rmin)), float(np.max(old.rmax)), "int8")
    assert not q.per_axis and q.scale == want.scale and q.zero_point == want.zero_point
    assert remapped["c1"] is qp["c1"]
    real = realize(mod, params, remapped, dst_cfg)
    rep = compare(dst, real, remapped, samples_for(data, dst.graph.inputs), target=TARGET)
    assert rep.exact, rep.table()
