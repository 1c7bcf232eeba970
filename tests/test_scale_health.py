"""No silently useless scales (issue 17, item 2): an extreme value late in the data or in
a later layer, a constant calibration input, an all-zero weight layer and a hand-edited
tiny scale. The checks assert the int8 model's output against the fp32 model (numpy
relative error), not only the warning."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
import tvm
from hypothesis import assume, given, settings
from tvm import relax

import autoq
from autoq.calibration import scale_health
from autoq.errors import CalibrationError, DatasetError
from models import TARGET, mlp

MOD, PARAMS, DATA = mlp()
SAMPLES = DATA(10)
TEST = DATA(8, seed=5)


def quantize(data, params=PARAMS, **config):
    cfg = autoq.Config(recipe="cnn", **config)
    return autoq.Quantizer(cfg, target=TARGET).run(MOD, params, data)


def rel_error(module, params=PARAMS):
    """Relative error of ``module`` against the fp32 model on the test samples (numpy)."""
    got, want = _outputs(module), _outputs(MOD, params)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want)), got


def _outputs(mod, params=None):
    """Outputs on every test sample, one compile."""
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    names = [p.name for p in mod["main"].params]
    weights = [tvm.runtime.tensor(params[n]) for n in names if params and n in params]
    return np.stack([vm["main"](tvm.runtime.tensor(x), *weights).numpy() for x in TEST])


@pytest.fixture(scope="module")
def clean_error():
    return rel_error(quantize(SAMPLES).module)[0]


@pytest.mark.parametrize("calibration", ["topological", "fp32"])
def test_extreme_value_late_in_the_data(calibration, clean_error):
    """1e30 in the last sample: minmax puts every ordinary value on the zero point (the
    output was all zeros). The layers reading those slots stay fp32, named in a warning."""
    data = [x.copy() for x in SAMPLES]
    data[9][0, 3] = 1e30
    with pytest.warns(UserWarning, match=r"fp32 because a chosen int8 scale.*fc1.*slot x"):
        r = quantize(data, calibration=calibration)
    assert r.fp32_layers["fc1"] == "unusable scale (scale health)"
    err, out = rel_error(r.module)
    assert np.abs(out).max() > 0.1
    assert err < 2 * clean_error + 0.01


def test_extreme_value_in_a_later_layer(clean_error):
    """fc1's bias 1e25 on one channel: the input is fine, relu_0 (fc2's input) is not."""
    params = dict(PARAMS)
    params["fc1.bias"] = params["fc1.bias"].copy()
    params["fc1.bias"][0] = 1e25
    with pytest.warns(UserWarning, match=r"slot relu_0"):
        r = quantize(SAMPLES, params)
    assert "fc2" in r.fp32_layers
    err, _ = rel_error(r.module, params)
    assert err < 0.05


@pytest.mark.parametrize("value", [0.0, 0.5])
def test_constant_calibration_input_is_refused(value):
    with pytest.raises(DatasetError, match=r"input 'x' holds the same value"):
        quantize([np.full_like(x, value) for x in SAMPLES])


def test_all_zero_weight_layer_keeps_its_bias(clean_error):
    """fc2's weights all zero: its output is its bias. The degenerate weight scale 1 made
    the bias step as coarse as the input scale (4x the normal error)."""
    params = dict(PARAMS)
    params["fc2.weight"] = np.zeros_like(params["fc2.weight"])
    r = quantize(SAMPLES, params)
    err, _ = rel_error(r.module, params)
    assert err < clean_error
    assert np.all(r.qparams["fc2.weight"].scale < 1e-3)


def test_hand_edited_tiny_scale_is_refused():
    qp = quantize(SAMPLES).qparams
    edited = qp.replace(relu_0=autoq.QParam(np.float32(1e-6), qp["relu_0"].zero_point))
    autoq.check_scales(MOD, PARAMS, qp, SAMPLES, target=TARGET)  # the calibrated ones fit
    with pytest.raises(CalibrationError, match=r"slot 'relu_0': \d+% of its values fall outside"):
        autoq.check_scales(MOD, PARAMS, edited, SAMPLES, target=TARGET)


def test_worked_examples():
    import doctest

    from autoq.calibration import scale_health

    assert doctest.testmod(scale_health).failed == 0


def test_check_can_be_turned_off():
    """Config(check_scales=False): the old behaviour, the useless scale is kept (output all
    zeros), and the configuration round-trips through JSON."""
    data = [x.copy() for x in SAMPLES]
    data[9][0, 3] = 1e30
    cfg = autoq.Config(recipe="cnn", check_scales=False)
    assert autoq.Config.loads(cfg.dumps()) == cfg
    r = autoq.Quantizer(cfg, target=TARGET).run(MOD, PARAMS, data)
    assert not r.fp32_layers
    assert np.all(_outputs(r.module) == 0)


@settings(max_examples=60, deadline=None)
@given(
    values=hnp.arrays(
        st.sampled_from([np.float32, np.float64]),
        st.integers(1, 300),
        elements=st.floats(-1e4, 1e4, allow_nan=False, width=32),
    ),
    scale=st.sampled_from([1e-3, 0.02, 0.37, 3.0, 50.0]),
    zero_point=st.integers(-30, 30),
)
def test_counts_match_the_rounded_grid(values, scale, zero_point):
    """The observer counts with thresholds (no division): on values away from a rounding
    boundary (x / s never exactly k + 1/2 here: such ties are a one-ulp band) they equal
    the definition on the grid, q = rint(x / s) + zp, counted in float64."""
    q_exact = values.astype(np.float64) / scale
    assume(not np.any(np.abs(q_exact - np.floor(q_exact) - 0.5) < 1e-6))
    obs = scale_health.HealthObserver(scale, zero_point, -128, 127)
    obs.update(values)
    q = np.rint(q_exact) + zero_point
    nonzero = values != 0
    want = [values.size, nonzero.sum(), (nonzero & (q == zero_point)).sum()]
    want.append(((q < -128) | (q > 127)).sum())
    assert obs.counts.tolist() == [int(v) for v in want]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("relu", [False, True])
def test_counts_on_the_thresholds_match_numpy(dtype, relu):
    """The value, non-zero and collapsed counts on values placed on and next to every
    threshold (+-half a step, the grid's ends), signed zeros, and nan/inf, against their
    definitions in plain numpy (``|x| <= half`` in the data's dtype, ``count_nonzero``),
    whatever path the observer takes (one comparison when no value is below ``-half``, as
    after a relu)."""
    rng = np.random.default_rng(3)
    scale, zp = 0.37, -7
    obs = scale_health.HealthObserver(scale, zp, -128, 127)
    half = dtype(0.5 * scale)
    edges = [half, -half, dtype(obs.below), dtype(obs.above), dtype(0.0), dtype(-0.0)]
    near = [np.nextafter(e, t, dtype=dtype) for e in edges for t in (dtype(-np.inf), dtype(np.inf))]
    want = np.zeros(3, np.int64)
    for batch in range(4):
        x = np.concatenate([np.array(edges + near, dtype), rng.normal(0, 30, 500).astype(dtype)])
        if batch == 3:
            x = np.append(x, np.array([np.nan, np.inf, -np.inf], dtype))
        if relu:
            x = np.maximum(x, dtype(0))  # nan stays nan
        rng.shuffle(x)
        obs.update(x)
        want += [x.size, np.count_nonzero(x), np.count_nonzero((np.abs(x) <= half) & (x != 0))]
    assert obs.counts[:3].tolist() == want.tolist()


def prob_map_model():
    """A text-detector head in miniature: conv 1x1 (1 -> 4) + bias, relu, conv 1x1 (4 -> 1)
    + bias -9, sigmoid: background ~1e-4, blobs ~1, their edges in between."""
    from models import Builder, conv

    b = Builder(0)
    x = b.input("x", (1, 1, 16, 16))

    def body(b):
        y = b.emit(relax.op.nn.relu(conv(b, x, "c1", 1, 4, k=1, pad=0)))
        y = conv(b, y, "c2", 4, 1, k=1, pad=0)
        return b.emit(relax.op.sigmoid(y))

    mod, params = b.build(body)
    params["c1.weight"] = np.full((4, 1, 1, 1), 1.0, np.float32)
    params["c1.bias"] = np.zeros(4, np.float32)
    params["c2.weight"] = np.full((1, 4, 1, 1), 4.0, np.float32)
    params["c2.bias"] = np.full(1, -9.0, np.float32)
    return mod, params


def blobs(n, seed):
    """Noise with a Gaussian bump (height 3) in 4 of every 5 samples."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:16, :16]
    out = []
    for i in range(n):
        img = rng.normal(scale=0.05, size=(16, 16))
        if i % 5:
            cy, cx = rng.uniform(4, 12, 2)
            img += 3.0 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * rng.uniform(1, 3) ** 2))
        out.append(img.reshape(1, 1, 16, 16).astype(np.float32))
    return out


def prob_map_reference(x, p):
    """The fp32 model in numpy."""
    h = np.maximum(x * p["c1.weight"].reshape(1, 4, 1, 1) + p["c1.bias"].reshape(1, 4, 1, 1), 0)
    z = (h * p["c2.weight"].reshape(1, 4, 1, 1)).sum(axis=1, keepdims=True) + p["c2.bias"]
    return 1.0 / (1.0 + np.exp(-z.astype(np.float64)))


def test_probability_map_output_stays_int8():
    """The output sigmoid of a probability map has ~90 % of its non-zero values on the zero
    point (background 1e-4 < half a step of [0, 1]), but its values fill the grid in most
    samples: the scale is healthy, the layer stays int8 (it went fp32 before), and the map
    thresholded at 0.3 matches numpy's."""
    import warnings

    mod, params = prob_map_model()
    calib, test = blobs(20, 0), blobs(10, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "keeping ... in fp32" warning
        # (lut_input_ranges off: the fp32-sigmoid variant below then reads the same logits)
        cfg = autoq.Config(recipe="cnn")
        r = autoq.Quantizer(cfg, target=TARGET).run(mod, params, calib)
    assert not r.fp32_layers
    out_slot = [s for s in r.qparams if r.qparams.slots[s].kind == "activation"][-1]
    assert r.qparams[out_slot].scale == pytest.approx(1 / 255, rel=0.05)
    got = _run_module(r.module, test)
    want = np.stack([prob_map_reference(x, params) for x in test])
    assert np.mean(np.abs(want) < 0.5 / 255) > 0.5  # most of the map collapses
    # the same calibration with the sigmoid kept in fp32 (what check_scales did before):
    # the int8 sigmoid adds at most one output step to its error (the rest is the int8 logit)
    cfg = cfg.replace(fallback=autoq.Fallback(ids=("sigmoid_0",)))
    fp32_sigmoid = _run_module(
        autoq.Quantizer(cfg, target=TARGET).run(mod, params, calib).module, test
    )
    assert np.abs(got - want).max() <= np.abs(fp32_sigmoid - want).max() + 1 / 255
    assert np.abs(got - fp32_sigmoid).max() <= 0.5 / 255 + 1e-6
    inter, union = np.sum((got > 0.3) & (want > 0.3)), np.sum((got > 0.3) | (want > 0.3))
    assert inter / union > 0.95


def _run_module(mod, xs):
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    return np.stack([vm["main"](tvm.runtime.tensor(x)).numpy() for x in xs])


def test_sparse_extremes_in_one_sample_stay_unusable():
    """The exemption needs both: values spread over the grid (16 bands) but from one sample
    of ten (an extreme late in the data) is a problem; so is a huge constant channel in
    every sample (two bands)."""
    spread_once = scale_health.SlotHealth(1000, 1000, 980, 0, -1.0, 1e30, 16, 1, 10)
    assert "round to the zero point" in scale_health.problem(spread_once, 3.9e27)
    constant_channel = scale_health.SlotHealth(1000, 1000, 960, 0, 0.0, 1e25, 2, 10, 10)
    assert "round to the zero point" in scale_health.problem(constant_channel, 3.9e22)
    # PP-OCRv4 det's sigmoid in the simulated graph with a coarse logit grid (measured)
    coarse = scale_health.SlotHealth(9216000, 9198687, 8863565, 0, 0.0, 1.0, 7, 31, 40)
    assert scale_health.problem(coarse, 1 / 255) is None


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        hnp.arrays(np.float32, st.integers(1, 200), elements=st.floats(-300, 300, width=32)),
        min_size=1,
        max_size=5,
    ),
    scale=st.sampled_from([0.01, 0.37, 1.0, 3.0]),
    zero_point=st.integers(-30, 30),
)
def test_bands_and_reaching_batches_match_numpy(batches, scale, zero_point):
    """Band counts (the grid [qmin - 1/2, qmax + 1/2] s cut into 16, values beyond it in the
    end bands) and batches reaching 64 steps from the zero point, against numpy in float64
    (values away from a band edge and from the reach threshold: those are one-ulp bands)."""
    width = 256 * scale / 16
    below = (-128 - zero_point - 0.5) * scale
    obs = scale_health.HealthObserver(scale, zero_point, -128, 127)
    want_bands, want_reach = np.zeros(16, np.int64), 0
    for x in batches:
        pos = (x.astype(np.float64) - below) / width
        assume(not np.any(np.abs(pos - np.rint(pos)) < 1e-4))
        far = np.abs(x.astype(np.float64)) / scale
        assume(not np.any(np.abs(far - 64) < 1e-4))
        obs.update(x)
        want_bands += np.bincount(np.clip(np.floor(pos), 0, 15).astype(int), minlength=16)
        want_reach += bool(np.any(far >= 64))
    h = obs.compute()
    assert obs.bands.tolist() == want_bands.tolist()
    assert h.occupied == np.count_nonzero(want_bands)
    assert (h.reaching, h.batches) == (want_reach, len(batches))


def test_bands_of_a_large_batch_come_from_a_regular_sample():
    """A batch larger than BAND_SAMPLE counts the bands of every k-th value (k the smallest
    step that leaves at most BAND_SAMPLE of them); every other count sees all values. Edge
    case: a value present only off the sample (here the single 250.0 at an odd index) is
    missed by the bands, but not by the range, the clipped count or the reaching batch."""
    n = 2 * scale_health.BAND_SAMPLE + 2  # step 3
    x = np.zeros(n, np.float32)
    x[::3] = np.linspace(-100, 100, len(x[::3]), dtype=np.float32)
    x[1] = 250.0
    obs = scale_health.HealthObserver(1.0, 0, -128, 127)
    obs.update(x)
    below, width = -128.5, 256 / 16
    sample = x[::3].astype(np.float64)
    want = np.bincount(np.clip(np.floor((sample - below) / width), 0, 15).astype(int), minlength=16)
    assert obs.bands.tolist() == want.tolist()
    h = obs.compute()
    assert (h.count, h.hi, h.clipped, h.reaching) == (n, 250.0, 1, 1)


def test_per_channel_grids_are_counted_on_each_channels_own_grid():
    """A per-channel slot (a depthwise input per channel): the counts are those of each
    channel's own grid, q = rint(x / s[c]) + z[c] in numpy; a channel of small values on
    its own fine grid is not collapsed (the grid covering every channel called most of this
    slot's values collapsed and sent its reader to fp32), a channel that is coarse for its
    values still is, and values beyond a channel's grid clip."""
    from autoq.qparams import QParam

    rng = np.random.default_rng(3)
    x = np.abs(rng.normal(size=(4, 3, 5, 5))).astype(np.float32)
    x[:, 0] *= 0.01  # small channel, own fine grid
    x[:, 2] *= 0.01  # small values on a coarse grid: collapsed
    x[0, 1, 0, 0] = 50.0  # beyond channel 1's grid
    qp = QParam.from_range(np.zeros(3), np.array([0.05, 6.0, 6.0]), "int8", axis=1)
    obs = scale_health.HealthCheck(qp).observer()
    obs.update(x)
    s = qp.scale.reshape(1, 3, 1, 1).astype(np.float64)
    z = qp.zero_point.reshape(1, 3, 1, 1)
    q = np.rint(x.astype(np.float64) / s) + z
    nonzero = x != 0
    want = [x.size, nonzero.sum(), (nonzero & (q == z)).sum(), ((q < -128) | (q > 127)).sum()]
    assert obs.counts.tolist() == [int(v) for v in want]
    per_channel = [(nonzero & (q == z))[:, c].sum() for c in range(3)]
    assert per_channel[0] < 0.05 * x[:, 0].size and per_channel[2] > 0.5 * x[:, 2].size
    assert (obs.lo, obs.hi) == (float(x.min()), 50.0)
    covering = scale_health.HealthObserver(6.0 / 255, -128, -128, 127)  # main's summary
    covering.update(x)
    assert covering.counts[2] > obs.counts[2]
