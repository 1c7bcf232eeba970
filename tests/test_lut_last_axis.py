"""Per-channel lookups on the last axis (``Config.lut_input_per_channel`` for a
transformer's GELU; the ``lookup`` kind of autoq.rules.residual_channels): which slots go per
channel, the realized per-channel lookup against numpy (generic lowering and the CPU
kernels), realized == simulated, per-channel calibration, the int16 escalation switching
one such slot, and a 4-D lookup written by a float op left per tensor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from test_hybrid import TOKEN
from tvm import relax

import autoq
from autoq import Config, Override, QuantSpec, realize, simulate
from autoq import primitives as P
from autoq.calibration import samples_for
from autoq.fallback.fidelity import compare
from autoq.metrics import sqnr_db
from autoq.qnn.lut import lut
from autoq.rules import residual_channels
from models import TARGET, Builder, Runner

SEQ, DIM, HID = 8, 16, 24
#: the FFN's intermediate channels' ranges: very different (as MiniLM's GELU inputs)
GAIN = np.geomspace(0.05, 8.0, HID)

HYBRID = Config(recipe="cnn", check_scales=False, smooth_quant=None, weight_rounding="nearest", overrides=(Override("pattern:dense*", activation=TOKEN),))  # fmt: skip
ON = HYBRID.replace(rules=("lookup_per_channel",))


def ffn(seed=0):
    """x -> dense (DIM -> HID, output channel c scaled by GAIN[c]) -> gelu -> dense
    (HID -> DIM): MiniLM's FFN without the residual (both dense layers dynamic in HYBRID)."""
    b = Builder(seed)
    x = b.input("x", (1, SEQ, DIM))

    def dense(name, y, w, n_out):
        out = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(out, b.weight(f"{name}.bias", b.rng.normal(size=n_out) * 0.1)))

    def body(b):
        w1 = b.weight("in.weight", b.rng.normal(size=(HID, DIM)) * GAIN.reshape(HID, 1) / 4)
        h = b.emit(relax.op.nn.gelu(dense("in", x, w1, HID)))
        return dense("out", h, b.randw("out.weight", (DIM, HID)), DIM)

    return b.build(body)


def gelu_only():
    """x [1, SEQ, HID] -> gelu -> reshape [SEQ, HID]: the input written by a float op (the
    model input), the output read by one (the reshape): both slots per channel."""
    b = Builder(5)
    x = b.input("x", (1, SEQ, HID))
    return b.build(lambda b: b.emit(relax.op.reshape(b.emit(relax.op.nn.gelu(x)), [SEQ, HID])))


def data(n, seed, width=DIM, gain=None):
    rng = np.random.default_rng(seed)
    g = np.ones(width) if gain is None else gain
    return [(rng.normal(size=(1, SEQ, width)) * g).astype(np.float32) for _ in range(n)]


CALIB = data(16, 1)


@pytest.fixture(scope="module")
def block():
    mod, params = ffn()
    return mod, params, autoq.Quantizer(ON, target=TARGET).run(mod, params, CALIB)


def _per_channel(sim) -> dict:
    return {s: sim.slots[s].axis for s in sim.activation_slots() if sim.slots[s].axis is not None}


def test_slot_choice(block):
    """The GELU's input (a dynamic dense result) and output (read by a dynamic dense)
    per channel on axis 2 with [HID] qparams; off: none. An int16 slot of the two stays per
    tensor, the other per channel. Static dense layers (a static dense writes per tensor and
    contracts the axis it reads): none."""
    mod, params, res = block
    sim = simulate(res.matched, None, res.config)
    slots = sim.plan.tables["gelu_0"][:2]
    assert _per_channel(sim) == dict.fromkeys(slots, 2)
    for s in slots:
        assert res.qparams[s].axis == 2 and np.shape(res.qparams[s].scale) == (HID,)
    assert _per_channel(simulate(mod, params, HYBRID)) == {}
    for wide, other in (slots, slots[::-1]):
        sim16 = simulate(mod, params, ON.replace(int16_tensors=(wide,)))
        assert _per_channel(sim16) == {other: 2}
    assert _per_channel(simulate(mod, params, ON.replace(overrides=()))) == {}


def _gelu64(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def test_realized_lookup_matches_numpy_on_both_lowerings():
    """x -> gelu -> reshape realized: numpy quantizes x per channel (last axis), computes
    each channel's GELU on its own input grid in float64 and rounds onto that channel's
    output grid, then dequantizes per channel; equal to the generic lowering and to the
    autoq.compile CPU kernels bit for bit."""
    mod, params = gelu_only()
    samples = data(8, 2, HID, GAIN)
    cfg = Config(recipe="cnn", check_scales=False, activation=QuantSpec(calibrator="max"), rules=("lookup_per_channel",))  # fmt: skip
    res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, samples)
    qi, qo = res.qparams["x"], res.qparams["gelu_0"]
    assert qi.axis == 2 and qo.axis == 2 and len(set(qo.scale.tolist())) == HID
    assert res.module["main"].script().count('"qnn.lut"') == 1
    generic = Runner(res.module)
    lib = autoq.compile(res.module, autoq.build.default_target(), cpu_kernels=True)
    vm = relax.VirtualMachine(lib, tvm.cpu())
    for x in samples[:3]:
        q = P.quantize(x, qi.scale, qi.zero_point, "int8", 2).astype(np.int64)
        real = ((q - qi.zero_point) * qi.scale).astype(np.float32)
        y = _gelu64(real.astype(np.float64)).astype(np.float32)
        qy = np.clip(np.rint(y / qo.scale.astype(np.float32)) + qo.zero_point, -128, 127)
        want = ((qy.astype(np.float32) - qo.zero_point) * qo.scale).astype(np.float32)
        want = want.reshape(SEQ, HID)
        np.testing.assert_array_equal(generic(x), want)
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), want)


def test_per_channel_lut_on_the_last_axis_matches_numpy():
    """qnn.lut with a [C, 256] table on the last axis of a 3-D tensor (planes of one
    element): generic lowering and both CPU kernels vs numpy's table[c, q - qmin]."""
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, size=(2, 5, HID)).astype(np.int8)
    table = rng.integers(-128, 128, size=(HID, 256)).astype(np.int8)
    want = table[np.arange(HID), q.astype(np.int64) + 128]
    x = relax.Var("x", relax.TensorType(list(q.shape), "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        bb.emit_func_output(bb.emit(lut(x, relax.const(table), -1)))
    mod = bb.get()
    np.testing.assert_array_equal(Runner(mod)(q), want)
    lib = autoq.compile(mod, autoq.build.default_target(), cpu_kernels=True)
    got = relax.VirtualMachine(lib, tvm.cpu())["main"](tvm.runtime.tensor(q)).numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("rounding", "int16"), [("float", ()), ("half_even", ()), ("float", (0,)), ("float", (1,))]
)
def test_realized_equals_simulated(block, rounding, int16):
    """Every slot's integers of the realized module == the calibrated simulation (float
    rounding: exact; half_even: within 1 LSB), the lookup carrying ``axis``; also with
    the GELU's input or output int16 (the activation in float, the other slot per channel:
    dequantize / quantize per axis)."""
    mod, params, res = block
    if rounding != "float" or int16:
        slots = simulate(res.matched, None, res.config).plan.tables["gelu_0"][:2]
        cfg = ON.replace(rounding=rounding, int16_tensors=tuple(slots[i] for i in int16))
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, CALIB)
    sim = simulate(res.matched, None, res.config)
    assert len(_per_channel(sim)) == 2 - len(int16)
    text = res.module["main"].script()
    assert text.count('"qnn.lut"') == (0 if int16 else 1)
    feeds = samples_for(data(3, 4), sim.graph.inputs)
    rep = compare(sim, res.module, res.qparams, feeds, TARGET)
    assert set(_per_channel(sim)) <= set(rep.elements), rep.table()
    worst = max(rep.max_lsb.values())
    assert rep.exact if rounding == "float" else worst <= 1, rep.table()


def test_per_channel_grids_follow_each_channel(block, monkeypatch):
    """The input slot's per-channel ranges follow GAIN (MSE calibration: each channel's own
    search). On held-out samples the per-channel model is closer to fp32 than the per-tensor
    one only with the headroom (autoq.rules.residual_channels.HEADROOM, 1.25: each channel's range
    from 128 tokens clips their tails; measured 37.5 dB, 27.9 dB at 1, 30.5 dB per tensor);
    on the calibration samples also without it. The headroom scales each channel's range."""
    mod, params, res = block
    sid = simulate(res.matched, None, res.config).plan.tables["gelu_0"][0]
    s = res.qparams[sid].scale
    assert residual_channels.HEADROOM == 1.25 and s[-1] > 20 * s[0]
    off = autoq.Quantizer(HYBRID, target=TARGET).run(mod, params, CALIB)
    monkeypatch.setattr(residual_channels, "HEADROOM", 1.0)
    tight = autoq.Quantizer(ON, target=TARGET).run(mod, params, CALIB)
    assert np.allclose(s, tight.qparams[sid].scale * 1.25, rtol=0.02)
    ref = Runner(mod, params)

    def sqnr(r, samples):
        run = Runner(r.module)
        return sqnr_db([ref(x) for x in samples], [run(x) for x in samples])

    assert sqnr(tight, CALIB) > sqnr(off, CALIB) + 3
    held = data(16, 9)
    assert sqnr(res, held) > max(sqnr(off, held), sqnr(tight, held)) + 3


def test_escalation_switches_a_last_axis_lookup_slot_to_int16(block):
    """autoq.fallback.escalation on the per-channel GELU input: all switches off = the calibrated
    realized module exactly; that slot switched on ~ the module realized with it in
    Config.int16_tensors (int16 per tensor, the GELU in float, its output per channel)."""
    from autoq.fallback.escalation import EscalationGraph

    mod, params, res = block
    sim = simulate(res.matched, None, res.config)
    sid = sim.plan.tables["gelu_0"][0]
    eg = EscalationGraph(sim, res.qparams, CALIB, TARGET)
    assert sid in eg.candidates
    test = data(3, 40)
    run8 = Runner(res.module)
    for got, x in zip(eg.run([], test), test, strict=True):
        np.testing.assert_array_equal(got, run8(x))
    c16 = ON.replace(int16_tensors=(sid,))
    sim16 = simulate(mod, params, c16)
    assert sim16.slots[sid].axis is None and sim16.plan.specs[sid].dtype == "int16"
    run16 = Runner(realize(mod, params, eg.qparams_with([sid], sim16), c16))
    ref16, got16 = [run16(x) for x in test], eg.run([sid], test)
    assert sqnr_db(ref16, got16) > 40.0


def test_a_4d_lookup_written_by_a_float_op_stays_per_tensor():
    """NCHW lookups are autoq.rules.lut_channels' (a conv writer, axis 1): a 4-D input written by
    a float op stays per tensor with the option on, and the module is the one without it."""
    b = Builder(3)
    x = b.input("x", (1, 4, 6, 6))
    mod, params = b.build(lambda b: b.emit(relax.op.nn.gelu(b.emit(relax.op.nn.relu(x)))))
    cfgs = [Config(recipe="cnn", check_scales=False, rules=() + (("lookup_per_channel",) if on else ()))
            for on in (False, True)]  # fmt: skip
    sims = [simulate(mod, params, c) for c in cfgs]
    assert _per_channel(sims[1]) == {}
    tvm.ir.assert_structural_equal(sims[0].mod, sims[1].mod)


@pytest.mark.parametrize("mode", ["topological", "fp32"])
def test_headroom_in_both_calibration_modes(mode):
    """The model input's per-channel slot (calibrator max): numpy's per-channel min / max
    grid, its range times HEADROOM quantized again, in both calibration modes."""
    mod, params = gelu_only()
    samples = data(8, 2, HID, GAIN)
    cfg = Config(recipe="cnn", check_scales=False, activation=QuantSpec(calibrator="max"), calibration=mode, rules=("lookup_per_channel",))  # fmt: skip
    qp = autoq.Quantizer(cfg, target=TARGET).run(mod, params, samples).qparams["x"]
    xs = np.concatenate(samples).reshape(-1, HID)
    s, z = P.choose_qparams(xs.min(axis=0), xs.max(axis=0), "int8", False, False, False)
    s, z, h = s.astype(np.float64), z.astype(np.float64), residual_channels.HEADROOM
    s, z = P.choose_qparams((-128 - z) * s * h, (127 - z) * s * h, "int8", False, False, False)
    np.testing.assert_allclose(qp.scale, s, rtol=1e-6)
    np.testing.assert_array_equal(qp.zero_point, z)
