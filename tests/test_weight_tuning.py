"""Data-aware weights inside calibration (autoq.accuracy.weight_tuning; Config.weight_rounding,
bias_correction): each checked against numpy references on small models, and
the realized int8 module against the simulated graph, bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from tvm import relax

from autoq import Config, calibrate, realize, simulate
from autoq import primitives as P
from autoq.accuracy.gptq import rtn
from autoq.accuracy.weight_tuning import layer_tasks, quantize_offset
from autoq.calibration import samples_for
from autoq.config import BiasCorrection
from autoq.fallback.fidelity import compare
from autoq.qparams import QParams
from models import TARGET, Runner, conv2d_nchw, small_cnn, two_convs

PLAIN = Config(recipe="cnn", weight_rounding="nearest")


def _smooth(n, seed, offset=0.0):
    """Images with spatially correlated pixels (upsampled 4x4 noise plus a little noise),
    like photos: neighbouring kernel taps see similar values, which GPTQ exploits."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = np.kron(rng.normal(size=(1, 3, 4, 4)), np.ones((1, 1, 2, 2)))
        out.append((x + offset + 0.1 * rng.normal(size=x.shape)).astype(np.float32))
    return out


def _calibrated(make, config, n=16, data=None):
    mod, params, own = make()
    data = data or own
    sim = simulate(mod, params, config)
    qp = calibrate(sim, params, data(n, 1), config, target=TARGET)
    return mod, params, data, sim, qp


def _input_slot(sim, layer):
    return next(t.input_slot for ts in layer_tasks(sim).values() for t in ts if t.layer == layer)


def _layer_input(sim, qp, layer, samples):
    """A first layer's quantized input on ``samples`` (dequantized), stacked."""
    x = qp[_input_slot(sim, layer)]
    return np.concatenate(
        [
            P.dequantize(P.quantize(s, x.scale, x.zero_point, x.dtype), x.scale, x.zero_point)
            for s in samples
        ]
    ).astype(np.float64)


def test_config_options_round_trip_and_are_validated():
    cfg = Config(recipe="cnn", weight_rounding="gptq", bias_correction=BiasCorrection(holdout=2))
    assert Config.from_json(cfg.to_json()) == cfg
    emp = Config(recipe="cnn", weight_rounding="nearest", bias_correction=BiasCorrection())
    assert Config.from_json(emp.to_json()) == emp and emp.tunes_weights
    with pytest.raises(ValueError, match=r"BiasCorrection\.holdout"):
        BiasCorrection(holdout=-1)
    with pytest.raises(ValueError, match="weight_rounding"):
        Config(recipe="cnn", weight_rounding="adaround")
    with pytest.raises(TypeError, match="bias_correction"):
        Config(recipe="cnn", bias_correction="yes")


def test_gptq_lowers_the_layer_output_error_versus_round_to_nearest():
    """On the calibration data, ``||conv(X, W) - conv(X, W_q)||`` for the integers GPTQ
    chose (``QParams.values``) is below round-to-nearest's with the same scales."""
    cfg = PLAIN.replace(weight_rounding="gptq")
    _, params, data, sim, qp = _calibrated(two_convs, cfg, data=_smooth)
    assert qp.meta["weight_tuning"]["gptq"] == 2
    x = _layer_input(sim, qp, "c1", data(16, 1))
    w, wq = params["c1.weight"].astype(np.float64), qp["c1.weight"]
    ref = conv2d_nchw(x, w, pad=1)
    near = rtn(w.reshape(4, -1), wq.scale).reshape(w.shape)
    errs = {}
    for name, q in (("gptq", qp.values["c1.weight"]), ("nearest", near)):
        wd = P.dequantize(q, wq.scale, wq.zero_point, axis=0).astype(np.float64)
        errs[name] = float(((conv2d_nchw(x, wd, pad=1) - ref) ** 2).mean())
    assert errs["gptq"] < 0.8 * errs["nearest"], errs


def test_empirical_bias_correction_matches_the_fp32_mean_output():
    """With ``empirical_bias_correction`` the realized model's output (the last conv's
    accumulator, dequantized) has, per channel, the fp32 model's mean over the calibration
    samples to within half an accumulator step: the correction also absorbs the mean error
    coming from the quantized first layer and the relu. Without it, the error is larger."""

    def shifted(n, seed):
        return _smooth(n, seed, offset=2.0)

    errors = {}
    for name, cfg in (
        ("off", PLAIN),
        ("empirical", PLAIN.replace(bias_correction=BiasCorrection())),
    ):
        mod, params, data, sim, qp = _calibrated(two_convs, cfg, data=shifted)
        x = data(16, 1)
        real, ref = Runner(realize(mod, params, qp, cfg)), Runner(mod, params)
        got = np.concatenate([real(s) for s in x]).astype(np.float64).mean(axis=(0, 2, 3))
        want = np.concatenate([ref(s) for s in x]).astype(np.float64).mean(axis=(0, 2, 3))
        acc = np.float32(qp[_input_slot(sim, "c2")].scale) * qp["c2.weight"].scale
        errors[name] = np.abs(got - want) / acc.astype(np.float64)  # in accumulator steps
    assert np.all(errors["empirical"] <= 0.5 + 1e-3), errors
    assert errors["off"].max() > 2.0, errors
    assert errors["off"].mean() > 2 * errors["empirical"].mean(), errors


@pytest.mark.parametrize(
    "changes",
    [
        {"weight_rounding": "gptq"},
        {"bias_correction": BiasCorrection()},
        {"weight_rounding": "gptq", "bias_correction": BiasCorrection()},
        {"weight_rounding": "gptq", "bias_correction": BiasCorrection(holdout=2)},
    ],
    ids=["gptq", "empirical", "gptq_empirical", "gptq_empirical_gated"],
)
def test_realized_module_equals_the_simulation_bit_for_bit(changes):
    config = PLAIN.replace(**changes)
    mod, params, data, sim, qp = _calibrated(small_cnn, config, n=8)
    qp = QParams.loads(qp.dumps())  # the integers survive JSON
    real = realize(mod, params, qp, config)
    test = samples_for(data(3, 7), sim.graph.inputs)
    rep = compare(sim, real, qp, test, target=TARGET)
    assert rep.exact and set(rep.elements) == set(sim.activation_slots()), rep.table()
    f, q = Runner(mod, params), Runner(real)
    x = data(3, 7)
    ref, got = np.stack([f(s) for s in x]), np.stack([q(s) for s in x])
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.04


@pytest.mark.parametrize("precision", ["fp32", "int16"])
def test_automatic_fallback_keeps_the_tuned_integers(precision):
    """The fallback search's final qparams carry the integers calibration chose for the
    layers still quantized (a corrected bias re-quantized for an int16 input), and the
    realized module still equals its simulation."""
    from autoq import AutoFallback, Quantizer

    mod, params, data = small_cnn()
    fb = AutoFallback(min_sqnr=200.0, max_fp32_layers=1, precision=precision)
    config = PLAIN.replace(weight_rounding="gptq", bias_correction=BiasCorrection(), fallback=fb)
    res = Quantizer(config, target=TARGET).run(mod, params, data(8, 1))
    assert res.decision.layers
    kept = [m.layer for m in res.matched.active(res.config.fallback)]
    assert {k.rsplit(".", 1)[0] for k in res.qparams.values} == {
        x for x in kept if f"{x}.weight" in res.qparams
    }
    sim = simulate(res.matched, None, res.config)
    test = samples_for(data(3, 7), sim.graph.inputs)
    rep = compare(sim, res.module, res.qparams, test, target=TARGET)
    assert rep.exact, rep.table()


def test_int16_first_keeps_the_tuned_biases_of_layers_reading_an_int16_slot():
    """``AutoFallback(precision="int16_first")`` with GPTQ + empirical bias correction: a
    layer whose input slot goes int16 keeps its corrected float bias (re-quantized at the
    new accumulator scale, not the int8 integers read at the int16 scale), so the realized
    module's output SQNR vs fp32 (numpy) is what the search measured, and every corrected
    bias dequantizes to the calibrated one to within an accumulator step."""
    from autoq import AutoFallback, Quantizer
    from autoq.metrics import sqnr_db

    mod, params, data = small_cnn()
    fb = AutoFallback(min_sqnr=200.0, max_fp32_layers=2, precision="int16_first")
    config = PLAIN.replace(weight_rounding="gptq", fallback=fb, bias_correction=BiasCorrection())
    res = Quantizer(config, target=TARGET).run(mod, params, data(8, 1))
    assert res.decision.int16_layers, res.decision.summary()
    base_cfg = config.replace(fallback=fb.fixed())
    base_sim = simulate(mod, params, base_cfg)
    base = calibrate(base_sim, params, data(8, 1), base_cfg, target=TARGET)
    sim = simulate(res.matched, None, res.config)
    moved = 0
    for layer, (_b, x_sid, w_sid) in sim.plan.biases.items():
        key = f"{layer}.bias"
        if key not in base.values:
            continue
        acc = np.float32(res.qparams[x_sid].scale) * res.qparams[w_sid].scale
        got, want = sim.value_input(key, res.qparams), base_sim.value_input(key, base)
        assert np.all(np.abs(got - want) <= acc + 1e-6), layer
        moved += res.qparams[x_sid].dtype == "int16"
    assert moved, "no corrected layer reads an int16 slot: the test checks nothing"
    x = data(8, 1)
    f, q = Runner(mod, params), Runner(res.module)
    realized = sqnr_db([f(s) for s in x], [q(s) for s in x])
    assert abs(realized - res.decision.metric) < 1.0, (realized, res.decision.metric)


def test_layers_with_the_same_patches_share_one_exact_hessian():
    """Two convs of the same geometry reading one slot (a block's first 1x1 conv and its
    projection shortcut) get one Hessian, fed once; a third geometry gets its own. Each
    equals the Hessian of that layer alone, also after a pickled shard is merged."""
    import pickle

    from autoq.accuracy.hessian import ConvGeometry
    from autoq.accuracy.weight_tuning import InputStats, LayerTask
    from autoq.qparams import QParam

    one = ConvGeometry(kernel=(1, 1), strides=(2, 2))
    three = ConvGeometry(kernel=(3, 3), padding=(1, 1, 1, 1))
    w1, w3 = np.zeros((8, 4, 1, 1), np.float32), np.zeros((8, 4, 3, 3), np.float32)
    tasks = [
        LayerTask("a", "a.weight", "x", w1, one, False),
        LayerTask("b", "b.weight", "x", w1[:5], one, False),
        LayerTask("c", "c.weight", "x", w3, three, False),
    ]
    qp = QParam(np.float32(0.5), np.int32(-3), "int8")
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(1, 4, 6, 6)).astype(np.float32) for _ in range(4)]
    stats, shard = InputStats(tasks, qp), pickle.loads(pickle.dumps(InputStats(tasks, qp)))
    assert stats.hessians["a"] is stats.hessians["b"] is not stats.hessians["c"]
    for x in xs[:2]:
        stats.update(x)
    for x in xs[2:]:
        shard.update(x)
    stats.merge(pickle.loads(pickle.dumps(shard)))
    for t in tasks:
        alone = InputStats([t], qp)
        for x in xs:
            alone.update(x)
        assert stats.hessians[t.layer].rows == alone.hessians[t.layer].rows
        np.testing.assert_array_equal(
            stats.hessians[t.layer].matrix(), alone.hessians[t.layer].matrix()
        )


def test_hessians_sum_products_only_for_layers_that_may_read_them():
    """GPTQ needs MIN_ROWS_PER_COLUMN rows per weight column: a layer whose rows, bounded by
    its input's static shape, stay below that is rounded to nearest and its Hessian sums
    only the rows (no products). With the scale search (which reads H) or an unknown shape,
    every layer gets its products. The tuned weights are those of the full Hessians."""
    from autoq.accuracy.hessian import ConvGeometry
    from autoq.accuracy.weight_tuning import MIN_ROWS_PER_COLUMN, LayerTask, WeightTuner

    one, three = ConvGeometry(kernel=(1, 1)), ConvGeometry(kernel=(3, 3), padding=(1, 1, 1, 1))
    small = LayerTask("a", "a.weight", "x", np.zeros((8, 4, 1, 1), np.float32), one, False)
    wide = LayerTask("c", "c.weight", "x", np.zeros((8, 64, 3, 3), np.float32), three, False)
    shape = (1, 64, 6, 6)  # 36 rows per sample; `wide` has 576 columns
    assert small.rows_bound((1, 4, 6, 6), 10) == 360 and wide.rows_bound(shape, 10) == 360
    assert wide.rows_bound((1, 64, 40, 40), 10) == 2560  # at most MAX_ROWS per sample
    assert wide.rows_bound(None, 10) is None

    x = relax.Var("x", relax.TensorType(list(shape), "float32"))
    sim = SimpleNamespace(plan=SimpleNamespace(tensors={"x": x}))  # what _product_layers reads
    tuner = WeightTuner.__new__(WeightTuner)
    tuner.sim, tuner.config = sim, Config(recipe="cnn")
    enough = MIN_ROWS_PER_COLUMN * 576 // 36  # samples that give `wide` GPTQ's minimum
    assert tuner._product_layers("x", [small, wide], enough - 1) == {"a"}
    assert tuner._product_layers("x", [small, wide], enough) == {"a", "c"}
    sim.plan.tensors = {}
    assert tuner._product_layers("x", [small, wide], 1) == {"a", "c"}  # shape unknown
    sim.plan.tensors = {"x": x}
    tuner.config = Config(recipe="cnn", weight_rounding="nearest")
    assert tuner._product_layers("x", [small, wide], 10**6) == set()


@pytest.mark.parametrize("means", [False, True], ids=["hessians", "with_mean_patches"])
def test_input_stats_hessians_equal_those_of_the_whole_quantized_input(means):
    """Each Hessian is fed codes gathered then quantized where that is fewer values (a 1x1
    conv keeping 256 of 400 pixels), or quantized then gathered (a 3x3 conv keeping all):
    the int64 sums equal those of the reference path, the whole input quantized by
    primitives.quantize minus the zero point, then fed to CodeHessian.update. With the
    bias correction's mean patches (``means``), the layers with a bias get the exact mean
    patch of those codes (the float64 tap-by-tap sums of the same integers, bit for bit);
    a layer without a bias gets none (it has nothing to correct)."""
    from autoq.accuracy.bias_correction import PatchMean
    from autoq.accuracy.hessian import ConvGeometry
    from autoq.accuracy.weight_tuning import InputStats, LayerTask
    from autoq.qparams import QParam

    one = ConvGeometry(kernel=(1, 1))
    three = ConvGeometry(kernel=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1))
    tasks = [
        LayerTask("a", "a.weight", "x", np.zeros((8, 4, 1, 1), np.float32), one, True),
        LayerTask("c", "c.weight", "x", np.zeros((8, 4, 3, 3), np.float32), three, False),
        LayerTask("d", "d.weight", "x", np.zeros((6, 4, 3, 3), np.float32), three, True),
    ]
    rng = np.random.default_rng(4)
    xs = [rng.normal(size=(1, 4, 20, 20)).astype(np.float32) * 3 for _ in range(3)]
    for qp in (QParam(np.float32(0.02), -128, "int8"), QParam(np.float32(1e-4), 7, "int16")):
        stats = InputStats(tasks, qp, patch_means=means)
        refs = {t.layer: t.hessian(float(qp.scale)) for t in tasks}
        ref_means = {t.layer: PatchMean(t.geom) for t in tasks if t.has_bias}
        for x in xs:
            stats.update(x)
            q = P.quantize(x, qp.scale, qp.zero_point, qp.dtype).astype(np.int64)
            codes = q - int(qp.zero_point)
            for h in refs.values():
                h.update(codes)
            for m in ref_means.values():
                m.update(codes.astype(np.float64))
        for t in tasks:
            got, ref = stats.hessians[t.layer], refs[t.layer]
            got.flush(), ref.flush()
            assert got.rows == ref.rows
            np.testing.assert_array_equal(got.sum, ref.sum)
            np.testing.assert_array_equal(got.row_sum, ref.row_sum)
        assert set(stats.means) == (set(ref_means) if means else set())
        for layer, ref in ref_means.items() if means else ():
            assert stats.means[layer].count == ref.count
            assert stats.means[layer].sum.tobytes() == ref.sum.tobytes()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int4"])
def test_quantize_offset_is_quantize_minus_the_zero_point(dtype):
    """The float32 codes weight tuning sums: the integers of quantize() - zero_point, for
    zero points at both ends and inside the range, ties, values far beyond the grid and
    infinities (float32 overflow of the division included)."""
    qmin, qmax = P.qrange(dtype)
    rng = np.random.default_rng(5)
    x = np.concatenate(
        [
            rng.normal(size=4000) * 3,
            rng.normal(size=400) * 1e6,
            [np.inf, -np.inf, 0.0, -0.0, 3e38, -3e38, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5],
        ]
    ).astype(np.float32)
    for zp in (qmin, qmax, (qmin + qmax) // 2, qmin + 1):
        for scale in (0.01, 0.5, 1.0, 7e-5):
            with np.errstate(over="ignore"):
                got = quantize_offset(x, scale, zp, dtype)
                ref = P.quantize(x, scale, zp, dtype).astype(np.int64) - zp
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got.astype(np.int64), ref)


def test_quantize_offset_rejects_what_it_cannot_do_exactly():
    with pytest.raises(ValueError, match="per tensor"):
        quantize_offset(np.zeros(2), np.array([0.1, 0.2]), 0)
    with pytest.raises(ValueError, match="16 bits"):
        quantize_offset(np.zeros(2), 0.1, 0, "int32")


def _depthwise_pool_dense():
    """depthwise 3x3 (pad 1) + bias -> relu -> global average pool -> dense + bias: the end
    of a MobileNet. Inputs are heavy-tailed and positive (exponential: a ReLU6 network's
    activations), so the activation range that minimizes the MSE clips the tail and the int8
    input's mean sits below the fp32 one: the depthwise layer's mean output, and with it the
    pooled mean the dense layer reads, shifts."""
    from models import Builder

    b = Builder(5)
    x = b.input("x", (1, 4, 8, 8))

    def body(b):
        w = np.abs(b.rng.normal(size=(4, 1, 3, 3))) * 0.5
        y = b.emit(relax.op.nn.conv2d(x, b.weight("dw.weight", w), padding=1, groups=4))
        db = b.weight("dw.bias", b.rng.normal(size=4) * 0.1)
        y = b.emit(relax.op.nn.relu(b.emit(relax.op.add(y, relax.op.reshape(db, [1, 4, 1, 1])))))
        y = b.emit(relax.op.reshape(b.emit(relax.op.mean(y, axis=[2, 3], keepdims=True)), [1, 4]))
        fw, fb = b.randw("fc.weight", (3, 4)), b.weight("fc.bias", b.rng.normal(size=3) * 0.1)
        return b.emit(
            relax.op.add(b.emit(relax.op.matmul(y, relax.op.permute_dims(fw, [1, 0]))), fb)
        )

    mod, params = b.build(body)
    rng = np.random.default_rng(6)
    data = [rng.exponential(size=(1, 4, 8, 8)).astype(np.float32) for _ in range(16)]
    return mod, params, data


def _patch_mean(x: np.ndarray) -> np.ndarray:
    """numpy: the mean over samples and output positions of a 3x3 pad-1 depthwise layer's
    input patches, ``(C, 9)`` (taps in kernel order)."""
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    h, w = x.shape[2:]
    taps = [xp[:, :, i : i + h, j : j + w].mean(axis=(0, 2, 3)) for i in range(3) for j in range(3)]
    return np.stack(taps, axis=1)


def test_depthwise_cnn_recipe_folds_the_depthwise_mean_shift_into_the_int32_bias():
    """The failing pattern of MobileNets (depthwise -> pool -> dense): without correction the
    int8 depthwise layer's mean output is many accumulator steps off fp32's and the model
    output's mean with it; the ``depthwise_cnn`` recipe (picked for the model, bias
    correction on by default) stores the int32 bias of the numpy fold
    ``b + W E[x_fp32] - W_q E[x~]`` (``E``: mean input patch over the calibration data,
    ``x~`` the int8 input, ``W_q`` the chosen int8 weights) and the output's mean matches
    fp32's to half an accumulator step of the dense layer."""
    from autoq import Quantizer

    mod, params, data = _depthwise_pool_dense()
    x = np.concatenate(data).astype(np.float64)
    fp32 = Runner(mod, params)
    want = np.concatenate([fp32(s) for s in data]).astype(np.float64).mean(axis=0)
    runs = {}
    for name, config in (("default", None), ("off", Config(bias_correction=False))):
        res = Quantizer(config, target=TARGET).run(mod, params, data)
        got = np.concatenate([Runner(res.module)(s) for s in data]).astype(np.float64)
        runs[name] = (res, np.abs(got.mean(axis=0) - want))
    res, _ = runs["default"]
    assert res.recipe[0] == "depthwise_cnn" and res.config.bias_correction == BiasCorrection()
    assert res.qparams.meta["weight_tuning"]["bias_corrected"] == 2
    off = runs["off"][0]
    assert off.config.bias_correction is False and "dw.bias" not in off.qparams.values

    def fold(r):
        qx, qw = r.qparams["x"], r.qparams["dw.weight"]
        x_q = P.dequantize(
            P.quantize(x, qx.scale, qx.zero_point, qx.dtype), qx.scale, qx.zero_point
        )
        w_int = r.qparams.values.get("dw.weight")
        if w_int is None:  # rounded to nearest
            w_int = P.quantize(params["dw.weight"], qw.scale, qw.zero_point, qw.dtype, axis=0)
        w_q = P.dequantize(w_int, qw.scale, qw.zero_point, axis=0).astype(np.float64)
        w = params["dw.weight"].astype(np.float64).reshape(4, 9)
        shift = (w * _patch_mean(x)).sum(axis=1) - (w_q.reshape(4, 9) * _patch_mean(x_q)).sum(
            axis=1
        )
        acc = (np.float32(qx.scale) * qw.scale).astype(np.float64)
        return shift, acc, qx, qw

    shift, acc, qx, qw = fold(off)
    assert np.abs(shift / acc).max() > 20, shift / acc  # the shift exists without correction
    shift, acc, qx, qw = fold(res)
    want_bias = P.quantize_bias((params["dw.bias"] + shift).astype(np.float32), qx.scale, qw.scale)
    np.testing.assert_array_equal(res.qparams.values["dw.bias"], want_bias.values)
    fc = res.qparams["fc.weight"].scale * np.float32(res.qparams[_input_slot_of(res, "fc")].scale)
    steps = {k: err / fc.astype(np.float64) for k, (_, err) in runs.items()}
    assert np.all(steps["default"] <= 0.5 + 1e-3), steps
    assert steps["off"].max() > 4, steps


def _input_slot_of(res, layer):
    sim = simulate(res.matched, None, res.config)
    return _input_slot(sim, layer)
