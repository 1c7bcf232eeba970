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
from autoq import scale_health
from autoq.errors import CalibrationError, DatasetError
from models import TARGET, mlp

MOD, PARAMS, DATA = mlp()
SAMPLES = DATA(10)
TEST = DATA(8, seed=5)


def quantize(data, params=PARAMS, **config):
    cfg = autoq.Config(progress=False, **config)
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

    from autoq import scale_health

    assert doctest.testmod(scale_health).failed == 0


def test_check_can_be_turned_off():
    """Config(check_scales=False): the old behaviour, the useless scale is kept (output all
    zeros), and the configuration round-trips through JSON."""
    data = [x.copy() for x in SAMPLES]
    data[9][0, 3] = 1e30
    cfg = autoq.Config(progress=False, check_scales=False)
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
