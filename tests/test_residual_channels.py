"""Per-channel scales on the residual stream's last axis (``Config.residual_per_channel``,
autoq.rules.residual_channels): which slots go per channel, the per-channel ``qnn.add`` against a
numpy reference built channel by channel from the per-tensor reference, realized ==
simulated, per-channel max calibration vs numpy, a gain on an outlier channel, option
errors / JSON, and modules unchanged where nothing is servable."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from test_escalation import DIM, OUTLIER, SEQ, data
from test_hybrid import TOKEN
from tvm import relax

import autoq
from autoq import AutoFallback, Config, Override, QuantSpec
from autoq import primitives as P
from autoq.calibration import samples_for
from autoq.distributed import check_rules_in_process
from autoq.errors import InputError
from autoq.fallback.fidelity import compare
from autoq.metrics import sqnr_db
from autoq.qnn import add, multiply, subtract
from autoq.rules import residual_channels
from autoq.simulation import simulate
from models import TARGET, Builder, Runner, run_tuple, small_cnn

#: the block's one dense layer dynamic per token (autoq.rules.hybrid), the rest static int8
HYBRID = Config(recipe="cnn", check_scales=False, smooth_quant=None, overrides=(Override("pattern:dense*", activation=TOKEN),))  # fmt: skip
ON = HYBRID.replace(rules=("residual_per_channel",))


def residual_block(seed=0):
    """x + pos -> LN0 -> reshape -> dense -> reshape, + LN0 -> LN1 (MiniLM's FFN residual
    without the dense bias: the add stays its own layer, canonicalization moves a residual
    before the reshape only for ``x @ W + b``); channel OUTLIER of the input and
    of LN0's gain ~30x the others (LN1's gain 1: the output shows every channel)."""
    b = Builder(seed)
    x = b.input("x", (1, SEQ, DIM))

    def ln(name, y, outlier=1.0):
        gamma = np.ones(DIM)
        gamma[OUTLIER] = outlier
        g, beta = b.weight(f"{name}.weight", gamma), b.weight(f"{name}.bias", np.zeros(DIM))
        return b.emit(relax.op.nn.layer_norm(y, g, beta, [-1]))

    def body(b):
        pos = b.weight("pos", b.rng.normal(size=(1, SEQ, DIM)) * 0.5)
        h = ln("ln0", b.emit(relax.op.add(x, pos)), 8.0)
        flat = b.emit(relax.op.reshape(h, [SEQ, DIM]))
        w = b.randw("fc.weight", (DIM, DIM))
        y = b.emit(relax.op.matmul(flat, relax.op.permute_dims(w, [1, 0])))
        r = b.emit(relax.op.reshape(y, [1, SEQ, DIM]))
        return ln("ln1", b.emit(relax.op.add(r, h)))

    return b.build(body)


def block_data(n, seed):
    """test_escalation's samples with the outlier channel 10x the others (not 40x)."""
    out = data(n, seed)
    for x in out:
        x[..., OUTLIER] /= 4.0
    return out


CALIB = block_data(48, 1)


@pytest.fixture(scope="module")
def block():
    mod, params = residual_block()
    res = autoq.Quantizer(ON, target=TARGET).run(mod, params, CALIB)
    return mod, params, res


def _per_channel(sim) -> dict:
    return {s: sim.slots[s].axis for s in sim.activation_slots() if sim.slots[s].axis is not None}


def test_slot_choice(block):
    """Per channel: the input (read by add_const), the position sum (layer ``pos``,
    add_const -> LN0),
    LN0's output (read by a reshape and the add), the dense result's reshape (read by the
    add) and the sum (add -> LN1); all on axis 2. Off: none. A tensor named by
    ``int16_tensors`` stays per tensor (16-bit slots are the escalation's, per tensor). A
    static dense layer reading LN0's output through the reshape: that reshape's slot is
    the dense input (contracted axis): per tensor, LN0's output still per channel."""
    mod, params, res = block
    sim = simulate(res.matched, None, res.config)
    assert _per_channel(sim) == dict.fromkeys(["x", "pos", "layer_norm_0", "reshape_1", "add_1"], 2)
    for s in _per_channel(sim):
        assert res.qparams[s].axis == 2 and np.shape(res.qparams[s].scale) == (DIM,)
    assert _per_channel(simulate(mod, params, HYBRID)) == {}
    wide = simulate(mod, params, ON.replace(int16_tensors=("layer_norm_0",)))
    assert "layer_norm_0" not in _per_channel(wide) and "add_1" in _per_channel(wide)
    static = simulate(mod, params, ON.replace(overrides=()))
    assert _per_channel(static) == dict.fromkeys(
        ["x", "pos", "layer_norm_0", "reshape_1", "add_1"], 2
    )
    assert "reshape_0" in static.activation_slots()  # the dense input: per tensor


@pytest.mark.parametrize(
    "rounding,static", [("float", False), ("half_even", False), ("float", True)]
)
def test_realized_equals_simulated(block, rounding, static):
    """Every slot's integers of the realized module == the calibrated simulation (float:
    exact; half_even: the integer qnn.add rounds the exact sum once, the simulation the
    float32 sum: within 1 LSB, as for per-tensor adds); the adds carry ``axis``. Also
    with the dense layer static (its result leaves through a per-tensor exit slot and a
    reshape into a per-channel slot)."""
    mod, params, res = block
    if rounding != "float" or static:
        cfg = ON.replace(rounding=rounding, overrides=() if static else ON.overrides)
        res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, CALIB)
    text = res.module["main"].script()
    assert text.count('"qnn.add"') == 2 and text.count('"axis": 2') >= 2
    sim = simulate(res.matched, None, res.config)
    test = block_data(3, 4)
    rep = compare(sim, res.module, res.qparams, samples_for(test, sim.graph.inputs), TARGET)
    assert set(_per_channel(sim)) <= set(rep.elements), rep.table()
    if rounding == "float":
        assert rep.exact, rep.table()
    else:
        assert max(rep.max_lsb.values()) <= 1, rep.table()


def test_calibration_is_per_channel_max(block):
    """The input slot's qparams: numpy's per-channel (last axis) min / max quantization of
    the calibration samples (calibrator ``max``, asymmetric int8), that grid's range times
    ``residual_channels.HEADROOM`` quantized again."""
    mod, params, _ = block
    cfg = ON.replace(activation=QuantSpec(calibrator="max"))
    res = autoq.Quantizer(cfg, target=TARGET).run(mod, params, CALIB)
    xs = np.concatenate(CALIB).reshape(-1, DIM)
    spec = res.config.activation
    flags = (spec.dtype, spec.symmetric, spec.narrow_range, spec.reduce_range)
    s, z = P.choose_qparams(xs.min(axis=0), xs.max(axis=0), *flags)
    (qmin, qmax), h = P.qrange(spec.dtype), residual_channels.HEADROOM
    s, z = s.astype(np.float64), z.astype(np.float64)
    s, z = P.choose_qparams((qmin - z) * s * h, (qmax - z) * s * h, *flags)
    np.testing.assert_allclose(res.qparams["x"].scale, s, rtol=1e-6)
    np.testing.assert_array_equal(res.qparams["x"].zero_point, z)


def test_closer_to_fp32_than_per_tensor(block):
    """On held-out samples the per-channel residual stream is closer to fp32 on the
    channels other than the outlier (the outlier channel's error, the same in both,
    dominates the output's energy: measured apart): 26.1 vs 23.8 dB with
    ``residual_channels.HEADROOM`` 1.25, level without it (24.0 vs 23.8 dB: a channel's
    range from few samples clips its rare large values, LN0's outputs in rows where the
    outlier is small, which one per-tensor grid spanning the outlier never does; on the
    calibration samples 29.5 vs 25.8 dB without the headroom, 27.1 with it)."""
    mod, params, res = block
    per_tensor = autoq.quantize(mod, params, CALIB, HYBRID)
    ref = Runner(mod, params)
    keep = np.arange(DIM) != OUTLIER
    held = block_data(24, 7)
    want = [ref(x)[..., keep] for x in held]
    on = sqnr_db(want, [Runner(res.module)(x)[..., keep] for x in held])
    off = sqnr_db(want, [Runner(per_tensor)(x)[..., keep] for x in held])
    assert on > off + 1.5, (on, off)


def _reference(kind, a, qa, b, qb, qo, dtype, rounding):
    """Channel ``c`` of the output: the per-tensor numpy reference with channel ``c``'s
    qparams (a per-tensor pair repeats)."""

    def at(q, c):
        s, z = q
        return (s[c], z[c]) if np.ndim(s) else (s, z)

    out = np.empty(a.shape, dtype)
    for c in range(a.shape[-1]):
        out[..., c] = P.elementwise(kind, a[..., c], *at(qa, c), b[..., c], *at(qb, c),
                                    *at(qo, c), dtype, rounding)  # fmt: skip
    return out


@pytest.mark.parametrize("rounding", ["float", "half_even", "half_away", "half_up"])
@pytest.mark.parametrize("kind", ["add", "subtract", "multiply"])
def test_qnn_per_channel_vs_numpy(kind, rounding):
    """``qnn.<kind>(..., axis=-1)``: lhs per tensor, rhs and output per channel (5 channels
    on the last axis), int8 and int16 operands, extremes included; == numpy per channel."""
    rng = np.random.default_rng(0)
    for dt in ("int8", "int16"):
        lo, hi = P.qrange(dt)
        a = rng.integers(lo, hi + 1, size=(2, 3, 5)).astype(dt)
        b = rng.integers(lo, hi + 1, size=(2, 3, 5)).astype(dt)
        a[0, 0], b[0, 0] = lo, hi
        qa = (np.float32(0.02), np.int32(3))
        qb = (
            rng.uniform(0.001, 0.05, 5).astype(np.float32),
            rng.integers(-9, 9, 5).astype(np.int32),
        )
        qo = (rng.uniform(0.01, 0.2, 5).astype(np.float32), rng.integers(-9, 9, 5).astype(np.int32))
        if kind == "multiply":
            qo = (qo[0] * 50, qo[1])
        fn = {"add": add, "subtract": subtract, "multiply": multiply}[kind]

        def body(va, vb, qa=qa, qb=qb, qo=qo, dt=dt, fn=fn):
            c = [relax.const(np.asarray(x)) for x in (*qa, *qb, *qo)]
            return [fn(va, vb, *c, out_dtype=dt, rounding=rounding, axis=-1)]

        got = run_tuple({"a": a, "b": b}, body)[0]
        np.testing.assert_array_equal(got, _reference(kind, a, qa, b, qb, qo, dt, rounding))


def test_qnn_per_channel_errors():
    """Per-channel qparams without ``axis``, on a broadcasting operand, or with the TFLite
    roundings: errors naming the op and the argument."""
    a = relax.Var("a", relax.TensorType([2, 4], "int8"))
    b1 = relax.Var("b", relax.TensorType([1, 4], "int8"))
    s, z = relax.const(np.ones(4, np.float32)), relax.const(np.zeros(4, np.int32))
    one, zero = relax.const(np.float32(1.0)), relax.const(np.int32(0))
    bb = relax.BlockBuilder()
    with pytest.raises(Exception, match=r"qnn\.add.*scalar"):
        bb.normalize(add(a, a, s, z, one, zero, one, zero))
    with pytest.raises(Exception, match="operands of the output's shape"):
        bb.normalize(add(a, b1, s, z, one, zero, one, zero, axis=-1))
    call = add(a, a, s, z, one, zero, one, zero, rounding="tflite", axis=-1)
    with pytest.raises(Exception, match="rounding float, half_even"):
        with bb.function("main", [a]):
            bb.emit_func_output(bb.emit(call))
        relax.transform.LegalizeOps()(bb.get())


def test_option_json_and_errors():
    assert Config.from_json(ON.to_json()) == ON and ON.to_json()["rules"] == [
        "residual_per_channel"
    ]
    with pytest.raises(InputError, match=r"residual_per_channel.*not supported with distributed"):
        check_rules_in_process(ON)


def test_per_axis_qparams_without_the_option_are_refused(block):
    """Per-channel qparams realized with the option off: the error names the option."""
    mod, params, res = block
    with pytest.raises(ValueError, match=r"Config\.rules 'residual_per_channel'"):
        autoq.realize(mod, params, res.qparams, HYBRID)


def _nchw_add():
    """x (NCHW) + a constant -> reshape: a servable writer / reader pair on a 4-D tensor."""
    b = Builder(0)
    x = b.input("x", (1, 2, 4, 4))
    c = b.weight("c", b.rng.normal(size=(1, 2, 4, 4)))
    return b.build(lambda b: b.emit(relax.op.reshape(b.emit(relax.op.add(x, c)), [1, 32])))


def test_cnn_unchanged():
    """A CNN (a conv's residual add, convs read the sums): nothing servable; simulated and
    realized modules identical with the option on and off. A 4-D (NCHW) tensor stays per
    tensor even where writer and readers could serve it (its last axis is spatial).
    (ResNet-50 and PP-OCRv4 det, checked outside the suite: simulated modules and slots
    identical with the option on and off.)"""
    nchw, nchw_params = _nchw_add()
    assert (
        _per_channel(
            simulate(nchw, nchw_params, Config(recipe="cnn", rules=("residual_per_channel",)))
        )
        == {}
    )
    mod, params, make_data = small_cnn()
    base = Config(recipe="cnn", check_scales=False)
    a = autoq.quantize(mod, params, make_data(2, 0), base)
    b = autoq.quantize(mod, params, make_data(2, 0), base.replace(rules=("residual_per_channel",)))
    # (the module attributes differ: they record the config)
    tvm.ir.assert_structural_equal(a["main"].body, b["main"].body, map_free_vars=True)
    assert _per_channel(simulate(mod, params, base.replace(rules=("residual_per_channel",)))) == {}


def test_escalation_may_widen_a_per_channel_slot():
    """The int16 escalation counts the per-channel slots among its candidates; one it picks
    becomes int16 per tensor (``int16_tensors``), the others stay per channel, and the
    realized module equals its simulation."""
    mod, params = residual_block()
    fb = AutoFallback(precision="int16_tensors", max_int16_fraction=0.4, holdout=2, min_sqnr=80.0)
    res = autoq.Quantizer(ON.replace(fallback=fb), target=TARGET).run(mod, params, CALIB[:12])
    wide = res.config.int16_tensors
    assert 1 <= len(wide) <= 2 and set(wide) <= {"x", "pos", "layer_norm_0", "reshape_1", "add_1"}
    sim = simulate(res.matched, None, res.config)
    assert set(_per_channel(sim)) == {"x", "pos", "layer_norm_0", "reshape_1", "add_1"} - set(wide)
    for s in wide:
        assert res.qparams[s].dtype == "int16" and res.qparams[s].axis is None
    rep = compare(
        sim, res.module, res.qparams, samples_for(block_data(3, 4), sim.graph.inputs), TARGET
    )
    assert rep.exact, rep.table()
