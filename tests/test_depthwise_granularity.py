"""Per tensor or per channel for each depthwise input, from held-out error
(``autoq/calibration/granularity.py``): on conv 1x1 -> ReLU6 -> depthwise 3x3 -> conv 1x1,
whose upstream quantization is exact (inputs on a 1/64 grid, weights on 1/128), the
calibrated ReLU6 slot against a numpy reference of the choice (fit on the first half, held
out error on the second, each channel's filter energy, the final grids on every sample);
realized == simulated with the ReLU6 dropped onto the per-channel grids, also when a
channel is 0 on every sample (a dead ReLU6 channel: the shared grid, not a degenerate
own one that would keep the ReLU6 in float)."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import relax

from autoq import Config, QParam, QuantSpec, calibrate, realize, simulate
from autoq.calibration import granularity, samples_for
from autoq.fallback.fidelity import compare
from autoq.ir.toolkit import bindings, op_name
from models import TARGET, Builder, conv2d_nchw

C = 6


def relu6_chain(late: float, dead: bool = False):
    """x (1/64 grid, [0, 255/64]) -> conv 1x1 (row c: m / 128 / 2^k_c, |m| <= 127, max
    127 in each row: exact weight scales; channel 0 wide, 1-4 16 times smaller, 5, the
    only one reading input channel 2, 4 times) -> clip(0, 6) -> depthwise 3x3 -> conv 1x1. Samples: 8; in the
    last ``late`` share of them input channel 2 (so clip channel 5) is large (its first-half range does not
    hold it). ``dead``: conv row 3 negative, so clip channel 3 is 0 on every sample."""
    b = Builder(5)
    x = b.input("x", (1, 3, 6, 6))
    m = np.zeros((C, 3, 1, 1))
    for c, (i, j) in enumerate([(0, 1), (1, 0), (0, 1), (1, 0), (0, 1), (2, 0)]):
        m[c, i], m[c, j] = 127, -((13 * c) % 100) - 1  # the row's max: weight scale exact
    if dead:
        m[3] = -np.abs(m[3])  # x >= 0: conv channel 3 <= 0, the ReLU6 output 0
    w1 = m / 128 * np.array([1, 1 / 16, 1 / 16, 1 / 16, 1 / 16, 1 / 4]).reshape(C, 1, 1, 1)

    def body(b):
        y = b.emit(relax.op.nn.conv2d(x, b.weight("c1.weight", w1)))
        r = b.emit(relax.op.clip(y, 0, 6))
        wd = b.randw("dw.weight", (C, 1, 3, 3))
        d = b.emit(relax.op.nn.conv2d(r, wd, padding=1, groups=C))
        return b.emit(relax.op.nn.conv2d(d, b.randw("c3.weight", (4, C, 1, 1))))

    mod, params = b.build(body)
    rng = np.random.default_rng(9)
    data = []
    for i in range(8):
        k = rng.integers(0, 256, (1, 3, 6, 6))
        k[0, :, 0, 0] = (0, 255, 255)  # every sample spans the input grid [0, 255/64]
        if i < 8 - int(late * 8):
            k[0, 2] = np.minimum(k[0, 2], 40)
        data.append((k / 64).astype(np.float32))
    return mod, params, data


def config():
    return Config(
        recipe="depthwise_cnn",
        activation=QuantSpec(dtype="int8", symmetric=False, calibrator="max"),
        weight_rounding="nearest",
        bias_correction=False,
    )


def fake_quant(x, scale, zp):
    s, z = np.reshape(scale, (1, -1, 1, 1)), np.reshape(zp, (1, -1, 1, 1))
    return (np.clip(np.rint(x / s) + z, -128, 127) - z) * s


def reference(values, weight):
    """The numpy choice: max-range grids (0 included) per channel and shared, fitted on
    the first half, squared error on the second times sum(w_c^2); own grids where lower
    when that halves the slot's error and the channel is not 0 on every sample; final
    grids from every sample."""
    v = np.concatenate(values)
    half = len(values) // 2
    fit, held = v[:half], v[half:]

    def grid(a, per_channel):
        axes = (0, 2, 3) if per_channel else None
        lo, hi = np.minimum(a.min(axis=axes), 0), np.maximum(a.max(axis=axes), 0)
        q = QParam.from_range(lo, hi, "int8", axis=1 if per_channel else None)
        return np.broadcast_to(q.scale, (C,)), np.broadcast_to(q.zero_point, (C,))

    energy = np.sum(weight.reshape(C, -1).astype(np.float64) ** 2, axis=1)
    err = {}
    for per_channel in (True, False):
        e = fake_quant(held, *grid(fit, per_channel)) - held
        err[per_channel] = energy * np.sum(e.astype(np.float64) ** 2, axis=(0, 2, 3))
    own = (err[True] <= err[False]) & (v.max(axis=(0, 2, 3)) > 0)
    if 2 * np.sum(np.where(own, err[True], err[False])) > np.sum(err[False]):
        own[:] = False
    (s1, z1), (s0, z0) = grid(v, True), grid(v, False)
    return own, np.where(own, s1, s0), np.where(own, z1, z0)


@pytest.mark.parametrize("late, dead", [(0.25, False), (0.0, False), (0.0, True)])
def test_choice_matches_numpy_and_realizes_exactly(late, dead):
    mod, params, data = relu6_chain(late, dead)
    cfg = config()
    sim = simulate(mod, params, cfg)
    slot = next(s for s, info in sim.plan.slots.items() if info.axis == 1)
    assert set(granularity.depthwise_slots(sim)) == {slot}
    qp = calibrate(sim, params, data, cfg, target=TARGET)
    # upstream exact: the slot's calibration values are the float model's
    values = [np.clip(conv2d_nchw(x, params["c1.weight"]), 0, 6) for x in data]
    own, scale, zp = reference(values, params["dw.weight"])
    if late:  # channel 5 grows only in the held half: shared grid there
        assert not own[5] and own.any()
    elif dead:  # channel 3 has no range of its own: shared grid there
        assert own.tolist() == [True, True, True, False, True, True]
    else:
        assert own.all()
    np.testing.assert_array_equal(qp[slot].scale, scale.astype(np.float32))
    np.testing.assert_array_equal(qp[slot].zero_point, zp)
    real = realize(mod, params, qp, cfg)
    assert "relax.clip" not in {op_name(v) for _, v in bindings(real["main"])}
    rep = compare(sim, real, qp, samples_for(data, sim.graph.inputs), target=TARGET)
    assert rep.exact, rep.table()


def test_equal_channels_realize_per_tensor():
    """A shared grid on every channel realizes as one per-tensor quantize."""
    qp = granularity.shared_grid(QParam(np.float32(0.25), -128), 4)
    assert qp.per_axis and qp.uniform().axis is None and qp.uniform().scale == np.float32(0.25)
    mixed = granularity.shared_grid(
        QParam(np.float32(0.25), -128), 2, QParam(np.float32([1, 2]), [0, 0], "int8", 1),
        np.array([True, False]),
    )  # fmt: skip
    assert mixed.scale.tolist() == [1.0, 0.25] and mixed.uniform() is mixed
