"""Per-channel lookup inputs (``autoq/rules/lut_channels.py``, ``Config.rules`` "lookup_per_channel"):
which slots go per channel, the realized conv -> per-channel requantize -> per-channel
table against numpy (generic lowering and the CPU kernels), realized == simulated, the
per-channel ``qnn.lut`` and its kernels against numpy, per-channel calibration against
numpy, the option's JSON round trip and errors, and models without a lookup unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config, QParam, QuantSpec, calibrate, realize, simulate
from autoq import primitives as P
from autoq.build import default_target
from autoq.calibration import samples_for
from autoq.calibrators.percentile import Percentile
from autoq.config import BiasCorrection
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.lut import (
    blocked_channel_lut_kernel,
    channel_lut_kernel,
    transpose_picks,
    vbmi_blocked_channel_lut_kernel,
    vbmi_channel_lut_kernel,
)
from autoq.distributed import check_rules_in_process
from autoq.errors import InputError
from autoq.fallback.fidelity import compare
from autoq.ir.canonicalize import hardswish
from autoq.ir.toolkit import bindings, is_call
from autoq.qnn.lut import lut
from autoq.rules.lut_channels import per_channel_inputs
from models import TARGET, Builder, Runner, conv2d_nchw, small_cnn

SCALES = np.array([0.1, 0.5, 1.0, 2.0, 4.0, 8.0])  # very different channel ranges


def conv_hswish(second_reader=False, tail=True):
    """conv 3x3 + bias (channel c's weights x SCALES[c]) -> hardswish [-> conv 1x1];
    ``second_reader``: the conv output is also added to the result (a second reader)."""
    b = Builder(11)
    x = b.input("x", (1, 3, 8, 8))
    w1 = b.rng.normal(size=(6, 3, 3, 3)) * SCALES.reshape(6, 1, 1, 1)

    def body(b):
        y = conv_bias(b, x, b.weight("c1.weight", w1), b.weight("c1.bias", b.rng.normal(size=6)))
        h = b.emit(hardswish(y))
        if tail:
            h = b.emit(relax.op.nn.conv2d(h, b.randw("c2.weight", (6, 6, 1, 1))))
        return b.emit(relax.op.add(h, y)) if second_reader else h

    mod, params = b.build(body)
    data = [np.random.default_rng(3 + i).normal(size=(1, 3, 8, 8)) for i in range(8)]
    return mod, params, [d.astype(np.float32) for d in data]


def conv_bias(b, x, w, bias):
    y = b.emit(relax.op.nn.conv2d(x, w, padding=1))
    return b.emit(relax.op.add(y, relax.op.reshape(bias, [1, 6, 1, 1])))


def cfg(on=True, more=(), **kw):
    spec = QuantSpec(calibrator=Percentile(percentile=99.9))
    kw.setdefault("weight_rounding", "nearest")
    return Config(
        recipe="cnn",
        activation=spec,
        rules=(("lookup_per_channel",) if on else ()) + tuple(more),
        **kw,
    )


def quantize(mod, params, data, config):
    sim = simulate(mod, params, config)
    qp = calibrate(sim, params, data, config, target=TARGET)
    return sim, qp, realize(mod, params, qp, config)


def test_slots_go_per_channel_only_for_a_conv_read_by_one_lookup():
    mod, params, _ = conv_hswish()
    on = simulate(mod, params, cfg())
    assert on.slots["c1"].axis == 1 and on.slots["autoq.hardswish_0"].axis is None
    assert [int(d) for d in on.table_vars["autoq.hardswish_0"].ty.shape] == [6, 256]
    assert simulate(mod, params, cfg(on=False)).slots["c1"].axis is None
    # a second reader (the residual add): per tensor, no error
    mod2, params2, _ = conv_hswish(second_reader=True)
    assert simulate(mod2, params2, cfg()).slots["c1"].axis is None
    # the lookup computed in float (16-bit output): per tensor
    int16 = cfg(int16_tensors=("autoq.hardswish_0",))
    assert simulate(mod, params, int16).slots["c1"].axis is None
    m = autoq.ir.matching.as_matched(mod, params, cfg())
    assert list(per_channel_inputs(m.graph, m.active(cfg().fallback), cfg(on=False))) == []


def test_pattern_overrides_decide_the_slot_like_id_overrides():
    """An Override selecting the lookup by pattern name (``pattern:``) reaches the
    per-channel choice as an id rule does: int16 there keeps the slot per tensor."""
    from autoq.config import Override

    mod, params, _ = conv_hswish()
    for rule in ("pattern:hardswish*", "autoq.hardswish_0"):
        over = (Override(rule, activation=QuantSpec(dtype="int16")),)
        assert simulate(mod, params, cfg(overrides=over)).slots["c1"].axis is None, rule
        over = (Override(rule, activation=QuantSpec(calibrator=Percentile(percentile=99.9))),)
        assert simulate(mod, params, cfg(overrides=over)).slots["c1"].axis == 1, rule


def _hardswish64(x):
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


def numpy_lookup_output(params, qp, x):
    """The realized conv -> hardswish in numpy from the qparams: int8 input and weights,
    int32 accumulator + bias, per-channel requantize, one table per channel (its own
    hardswish and rounding), dequantized with the table output's qparams."""
    xq, wq, cq, oq = qp["x"], qp["c1.weight"], qp["c1"], qp["autoq.hardswish_0"]
    q_x = P.quantize(x, xq.scale, xq.zero_point, "int8").astype(np.int64) - int(xq.zero_point)
    q_w = P.quantize(params["c1.weight"], wq.scale, wq.zero_point, "int8", 0)
    acc = np.rint(conv2d_nchw(q_x.astype(np.float64), q_w.astype(np.float64), pad=1))
    s_acc = (xq.scale * wq.scale).astype(np.float32)
    bias = P.quantize_bias(params["c1.bias"], xq.scale, wq.scale).values.reshape(1, 6, 1, 1)
    acc = (acc + bias).astype(np.int32)
    q_c = P.requantize(acc, s_acc, 0, cq.scale, cq.zero_point, "int8", axis=1)
    out = np.empty_like(q_c)
    for c in range(6):
        real = ((q_c[:, c].astype(np.int64) - cq.zero_point[c]) * cq.scale[c]).astype(np.float32)
        y = _hardswish64(real.astype(np.float64)).astype(np.float32)
        v = np.rint(y / np.float32(oq.scale)) + int(oq.zero_point)
        out[:, c] = np.clip(v, -128, 127)
    return ((out.astype(np.float32) - np.float32(oq.zero_point)) * oq.scale).astype(np.float32)


def test_realized_conv_and_tables_match_numpy_on_both_lowerings():
    """On VBMI CPUs the conv stores the blocked layout and the lookup reads it and stores
    the NCHW tensor the dequantize reads (``autoq_lut_unblocked``)."""
    mod, params, data = conv_hswish(tail=False)
    _, qp, real = quantize(mod, params, data, cfg(more=("lookup_input_ranges",)))
    assert qp["c1"].axis == 1 and len(set(qp["c1"].scale.tolist())) == 6
    if "avx512vbmi" in open("/proc/cpuinfo").read():
        with default_target() as host:
            low = lower_to_cpu_kernels(real, host)
        calls = [
            e.args[0].name_hint for _, e in bindings(low["main"]) if is_call(e, "relax.call_tir")
        ]
        assert "autoq_lut_unblocked" in calls, calls
    want = [numpy_lookup_output(params, qp, x) for x in data[:3]]
    generic = Runner(real)
    lib = autoq.compile(real, autoq.build.default_target(), cpu_kernels=True)
    vm = relax.VirtualMachine(lib, tvm.cpu())
    for x, w in zip(data[:3], want, strict=True):
        np.testing.assert_array_equal(generic(x), w)
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), w)


@pytest.mark.parametrize(
    ("rounding", "ebc"), [("float", False), ("float", True), ("half_away", False)]
)
def test_realized_equals_simulated(rounding, ebc):
    """Also with GPTQ and empirical bias correction (the PP-OCR recipe's weight tuning)."""
    mod, params, data = conv_hswish()
    config = cfg(
        more=("lookup_input_ranges",),
        rounding=rounding,
        weight_rounding="gptq",
        bias_correction=BiasCorrection() if ebc else None,
    )
    sim, qp, real = quantize(mod, params, data, config)
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    if rounding == "float":
        assert rep.exact, rep.table()
    else:  # integer requantize: within one step of the simulated (float) rounding
        assert max(rep.max_lsb.values()) <= 1, rep.table()
    assert set(rep.elements) == set(sim.activation_slots())
    if ebc:  # per-channel qparams realized without the option: a clear error
        with pytest.raises(ValueError, match=r"c1.*per-axis.*lookup_per_channel"):
            realize(mod, params, qp, cfg(on=False))


def test_per_channel_calibration_matches_numpy():
    """fp32 calibration with ``max``: each channel's [min(0, lo), max(0, hi)] of the conv's
    float output (numpy), as QParam.from_range per channel."""
    mod, params, data = conv_hswish()
    config = Config(
        recipe="cnn",
        activation=QuantSpec(calibrator="max"),
        calibration="fp32",
        weight_rounding="nearest",
        rules=("lookup_per_channel",),
    )
    sim = simulate(mod, params, config)
    qp = calibrate(sim, params, data, config, target=TARGET)
    w, b = params["c1.weight"].astype(np.float64), params["c1.bias"].astype(np.float64)
    ys = np.stack([conv2d_nchw(x.astype(np.float64), w, pad=1) for x in data])
    ys = ys + b.reshape(1, 1, 6, 1, 1)
    lo = np.minimum(ys.min(axis=(0, 1, 3, 4)), 0.0)
    hi = np.maximum(ys.max(axis=(0, 1, 3, 4)), 0.0)
    want = QParam.from_range(lo, hi, "int8", axis=1)
    np.testing.assert_allclose(qp["c1"].scale, want.scale, rtol=1e-5)
    assert np.abs(qp["c1"].zero_point - want.zero_point).max() <= 1


def test_per_channel_lut_op_and_kernels_match_numpy():
    rng = np.random.default_rng(5)
    shape = (2, 5, 7, 11)  # 77-element planes: a 64-byte vector and a scalar tail each
    x = rng.integers(-128, 128, shape).astype(np.int8)
    x.reshape(-1)[:256] = np.arange(-128, 128)
    table = rng.integers(-128, 128, (5, 256)).astype(np.int8)
    want = table[np.arange(5).reshape(1, 5, 1, 1), x.astype(np.int32) + 128]
    xv = relax.Var("x", relax.TensorType(shape, "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [xv]):
        bb.emit_func_output(bb.emit(lut(xv, relax.const(table), axis=1)))
    mod = bb.get()
    np.testing.assert_array_equal(Runner(mod)(x), want)
    np.testing.assert_array_equal(
        relax.VirtualMachine(autoq.compile(mod), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy(),
        want,
    )
    host = autoq.build.default_target()
    kernels = [channel_lut_kernel]
    if "avx512vbmi" in open("/proc/cpuinfo").read():
        kernels.append(vbmi_channel_lut_kernel)
    for kernel in kernels:
        lib = tvm.compile(tvm.IRModule({"main": kernel(shape, 1, "int8", "int8")}), host)
        got = tvm.runtime.tensor(np.zeros(shape, np.int8))
        lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(table), got)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=kernel.__name__)


@pytest.mark.parametrize("shape", [(2, 3, 5, 13, 16), (1, 2, 8, 8, 16), (1, 1, 4, 5, 16)])
def test_blocked_per_channel_lut_kernels_match_numpy(shape):
    """The channel-blocked layout (stored byte = index, lane i of block c: channel 16 c + i):
    the gather and (on VBMI CPUs) the transposing kernel, 64-pixel groups with and without a
    scalar tail, every index."""
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, shape).astype(np.uint8)
    x.reshape(-1)[:256] = np.arange(256)
    table = rng.integers(0, 256, (shape[1] * 16, 256)).astype(np.uint8)
    channel = (np.arange(shape[1]).reshape(-1, 1) * 16 + np.arange(16)).reshape(1, -1, 1, 1, 16)
    want = table[channel, x]
    host = default_target()
    runs = [(blocked_channel_lut_kernel(shape, "uint8"), [])]
    if "avx512vbmi" in open("/proc/cpuinfo").read():
        runs.append((vbmi_blocked_channel_lut_kernel("uint8"), [transpose_picks()]))
    for kernel, extra in runs:
        lib = tvm.compile(tvm.IRModule({"main": kernel}), host)
        got = tvm.runtime.tensor(np.zeros(shape, np.uint8))
        args = [tvm.runtime.tensor(a) for a in (x, table, *extra)]
        lib["main"](*args, got)
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize(
    ("shape", "channels"), [((2, 3, 5, 13, 16), 40), ((1, 2, 8, 8, 16), 32), ((1, 1, 4, 5, 16), 3)]
)
@pytest.mark.skipif("avx512vbmi" not in open("/proc/cpuinfo").read(), reason="no AVX-512 VBMI")
def test_unblocked_per_channel_lut_kernel_matches_numpy(shape, channels):
    """Blocked input (stored byte = index, lane i of block c: channel 16 c + i), NCHW output
    of ``channels`` channels (the padded lanes of the last block not stored: 40 of 48, 3 of
    16): 64-pixel groups with and without a scalar tail, every index, int8 tables."""
    rng = np.random.default_rng(7)
    x = rng.integers(0, 256, shape).astype(np.uint8)
    x.reshape(-1)[:256] = np.arange(256)
    table = rng.integers(-128, 128, (shape[1] * 16, 256)).astype(np.int8)
    n, _, h, w, _ = shape
    blocked = x.transpose(0, 1, 4, 2, 3).reshape(n, -1, h, w)[:, :channels]  # NCHW indices
    want = table[np.arange(channels).reshape(1, -1, 1, 1), blocked]
    lib = tvm.compile(
        tvm.IRModule({"main": vbmi_blocked_channel_lut_kernel("int8", nchw=True)}), default_target()
    )
    got = tvm.runtime.tensor(np.full((n, channels, h, w), 99, np.int8))
    lib["main"](*[tvm.runtime.tensor(a) for a in (x, table, transpose_picks())], got)
    np.testing.assert_array_equal(got.numpy(), want)


def test_per_channel_lut_type_errors_name_the_argument():
    xv = relax.Var("x", relax.TensorType((1, 4, 2, 2), "int8"))
    bb = relax.BlockBuilder()
    with pytest.raises(Exception, match=r"table.*\[4, 256\]"):
        with bb.function("main", [xv]):
            bb.emit(lut(xv, relax.const(np.zeros((3, 256), np.int8)), axis=1))


def test_option_json_round_trip_and_errors():
    c = Config(recipe="cnn", rules=("lookup_per_channel",))
    assert Config.from_json(c.to_json()) == c and c.has_rule("lookup_per_channel")
    assert not Config.from_json(Config(recipe="cnn").to_json()).has_rule("lookup_per_channel")
    with pytest.raises(ValueError, match=r"Config\.rules: unknown rule.*lookup_per_chanel"):
        Config(recipe="cnn", rules=("lookup_per_chanel",))
    mod, params, _ = conv_hswish()
    sim = simulate(mod, params, c)
    with pytest.raises(InputError, match=r"lookup_per_channel.*not supported with distributed"):
        check_rules_in_process(sim.config)


def test_models_without_a_lookup_are_unchanged():
    """small_cnn (conv, relu, residual add, pools, dense; no lookup): the simulated and the
    realized modules are identical with the option on and off."""
    mod, params = small_cnn()[:2]
    data = [
        np.random.default_rng(i).normal(size=(1, 3, 16, 16)).astype(np.float32) for i in range(3)
    ]
    results = [quantize(mod, params, data, cfg(on=on)) for on in (False, True)]
    (s0, q0, r0), (s1, q1, r1) = results
    tvm.ir.assert_structural_equal(s0.mod, s1.mod)
    assert {s: q0[s] for s in s0.slots} == {s: q1[s] for s in s1.slots}
    tvm.ir.assert_structural_equal(r0, r1)


def test_escalation_switches_a_per_channel_slot_to_int16():
    """autoq.fallback.escalation on a per-channel lookup input: all switches off = the calibrated
    realized module exactly; that slot switched on ~ the module realized with
    Config.int16_tensors=(slot,) (a per-tensor int16 slot, its lookup in float)."""
    from autoq.fallback.escalation import EscalationGraph
    from autoq.metrics import sqnr_db

    mod, params, data = conv_hswish()
    c = cfg()
    sim, qp, real8 = quantize(mod, params, data, c)
    eg = EscalationGraph(sim, qp, data, TARGET)
    assert sim.slots["c1"].axis == 1 and "c1" in eg.candidates
    test = [np.random.default_rng(40 + i).normal(size=(1, 3, 8, 8)).astype(np.float32)
            for i in range(3)]  # fmt: skip
    run8 = Runner(real8)
    for got, x in zip(eg.run([], test), test, strict=True):
        np.testing.assert_array_equal(got, run8(x))
    c16 = cfg(int16_tensors=("c1",))
    sim16 = simulate(mod, params, c16)
    assert sim16.slots["c1"].axis is None and sim16.plan.specs["c1"].dtype == "int16"
    run16 = Runner(realize(mod, params, eg.qparams_with(["c1"], sim16), c16))
    ref16, got16 = [run16(x) for x in test], eg.run(["c1"], test)
    assert sqnr_db(ref16, got16) > 40.0
    assert sqnr_db(ref16, got16) > sqnr_db(ref16, eg.run([], test)) + 10.0
