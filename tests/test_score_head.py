"""A YOLO-style detector head stays int8 (issue 34, item 4): boxes in input pixels (0-320)
concatenated with class-score sigmoids that are ~0 at nearly every anchor. The score
sigmoid's output has most of its non-zero values on the zero point, which scale health
called an unusable scale ("an extreme value in one sample?") and kept in fp32; a bounded
lookup's output grid can never be wider than the activation's range, so that collapse is
the data, not a defect. The concat keeps one grid per input (each input is dequantized on
its own grid), so the scores are not rounded on the boxes' 1.2-pixel step. Checked against
the model in numpy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq.calibration import scale_health
from autoq.errors import CalibrationError
from models import TARGET, Builder, conv, conv2d_nchw

SIDE, CLASSES = 8, 3


def head_model():
    """x (1, 3, 8, 8) -> conv 3x3 + relu -> (a) conv 1x1 to 4 box logits, sigmoid * 320;
    (b) conv 1x1 to 3 class logits with bias -9, sigmoid; both reshaped to (1, k, 64) and
    concatenated on axis 1: the (1, 4 + C, N) output of a decoded YOLO head."""
    b = Builder(0)
    x = b.input("x", (1, 3, SIDE, SIDE))
    n = SIDE * SIDE

    def body(b):
        f = b.emit(relax.op.nn.relu(conv(b, x, "stem", 3, 8)))
        box = b.emit(relax.op.sigmoid(conv(b, f, "box", 8, 4, k=1, pad=0)))
        box = b.emit(relax.op.multiply(box, relax.const(320.0)))
        cls = b.emit(relax.op.sigmoid(conv(b, f, "cls", 8, CLASSES, k=1, pad=0)))
        box = b.emit(relax.op.reshape(box, (1, 4, n)))
        cls = b.emit(relax.op.reshape(cls, (1, CLASSES, n)))
        return b.emit(relax.op.concat([box, cls], axis=1))

    mod, params = b.build(body)
    params["cls.weight"] = np.abs(params["cls.weight"]) * 3.0
    params["cls.bias"] = np.full(CLASSES, -9.0, np.float32)
    return mod, params


def reference(x: np.ndarray, p: dict) -> np.ndarray:
    """The fp32 model in numpy (float64)."""
    x = x.astype(np.float64)

    def conv_(y, name, pad):
        w, bias = p[f"{name}.weight"].astype(np.float64), p[f"{name}.bias"].astype(np.float64)
        return conv2d_nchw(y, w, pad) + bias.reshape(1, -1, 1, 1)

    def sigmoid(v):
        return 1.0 / (1.0 + np.exp(-v))

    f = np.maximum(conv_(x, "stem", 1), 0.0)
    box = 320.0 * sigmoid(conv_(f, "box", 0)).reshape(1, 4, -1)
    cls = sigmoid(conv_(f, "cls", 0)).reshape(1, CLASSES, -1)
    return np.concatenate([box, cls], axis=1)


def data(n: int, seed: int) -> list[np.ndarray]:
    """Noise (the background: every score ~1e-4) with a bright square (an object: scores up
    to ~1 around it) in one sample of four (as in real images, most have no object: fewer
    than half of the samples reach a quarter of the score grid, which kept the grid from
    counting as used)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = rng.normal(scale=0.3, size=(1, 3, SIDE, SIDE))
        if i % 4 == 1:
            r, c = rng.integers(0, SIDE - 2, 2)
            x[:, :, r : r + 2, c : c + 2] += rng.uniform(2.0, 4.0)
        out.append(x.astype(np.float32))
    return out


def outputs(mod, xs):
    """The module's output on each input, one compile."""
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    return np.stack([vm["main"](tvm.runtime.tensor(x)).numpy() for x in xs])


@pytest.fixture(scope="module")
def head():
    """The model, its calibration and test inputs, numpy's outputs on the test inputs and
    the default quantization (warnings as errors: no "keeping ... in fp32")."""
    mod, params = head_model()
    calib, test = data(16, 0), data(16, 1)
    want = np.stack([reference(x, params) for x in test])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = autoq.Quantizer(target=TARGET).run(mod, params, calib)
    return mod, params, calib, test, want, r


def test_sparse_scores_stay_int8_on_their_own_grid(head):
    mod, params, calib, test, want, r = head
    scores = want[:, 0, 4:]
    assert np.mean(scores < 0.5 / 255) > 0.5  # most scores collapse on a [0, 1] grid
    assert np.any(scores > 0.5)  # and some anchors are objects
    assert r.recipe[0] == "cnn" and not r.fp32_layers
    out_qp = r.qparams["sigmoid_1"]
    assert float(out_qp.grid_range()[1]) <= 1.0 + float(out_qp.scale)
    got = outputs(r.module, test)
    # the scores on their own grid (step <= 1/255, not the boxes' ~1.2 px): the int8 sigmoid
    # adds at most one output step to the error the int8 logits make (the same calibration
    # with the sigmoid in fp32, what check_scales did before)
    cfg = autoq.Config(fallback=autoq.Fallback(ids=("sigmoid_1",)))
    fp32_sig = outputs(autoq.Quantizer(cfg, target=TARGET).run(mod, params, calib).module, test)
    step = float(out_qp.scale)
    assert np.abs(got[:, 0, 4:] - scores).max() <= np.abs(fp32_sig[:, 0, 4:] - scores).max() + step
    # the detections (score > 0.25) are the fp32 model's but for anchors within the logits'
    # error of the threshold
    near = np.abs(fp32_sig[:, 0, 4:] - 0.25) <= np.abs(fp32_sig[:, 0, 4:] - scores) + step
    assert np.array_equal((got[:, 0, 4:] > 0.25) | near, (scores > 0.25) | near)
    assert np.sum(scores > 0.25) > 3 * np.sum(near)
    # the boxes keep their grid too: within a few of its steps of numpy
    box_step = float(r.qparams["multiply_0"].scale)
    assert np.abs(got[:, 0, :4] - want[:, 0, :4]).mean() < box_step


def test_check_scales_still_refuses_a_grid_wider_than_the_sigmoid(head):
    """The exemption is for grids inside [0, 1]: qparams whose sigmoid output grid spans
    [0, 100] (hand-edited) still fail the check, with the cause named."""
    mod, params, calib, _, _, r = head
    qp = r.qparams
    autoq.check_scales(mod, params, qp, calib, target=TARGET)  # the calibrated ones fit
    edited = qp.replace(sigmoid_1=autoq.QParam(np.float32(100 / 255), np.int32(-128)))
    with pytest.raises(CalibrationError, match=r"'sigmoid_1': 9.% of its non-zero values round"):
        autoq.check_scales(mod, params, edited, calib, target=TARGET)


def _health(batches, scale, zero_point=-128):
    obs = scale_health.HealthObserver(scale, zero_point, -128, 127)
    for x in batches:
        obs.update(np.asarray(x, np.float32))
    return obs.compute()


def test_the_warning_names_the_cause():
    """Counted from numpy data: sparse scores (3 of 10 samples reach a quarter of the grid)
    are named as such, an extreme value in one sample as that, a distant constant as that."""
    rng = np.random.default_rng(0)
    background = [rng.uniform(0, 1e-3, 500) for _ in range(10)]
    sparse = [
        b if i % 4 else np.append(b, rng.uniform(0.3, 0.9, 5)) for i, b in enumerate(background)
    ]
    h = _health(sparse, 0.9 / 255)
    assert "sparse score" in scale_health.problem(h, 0.9 / 255)
    assert scale_health.problem(h, 0.9 / 255, bounded=True) is None
    extreme = [*background[:9], np.append(background[9], 1e6)]
    why = scale_health.problem(_health(extreme, 1e6 / 255), 1e6 / 255)
    assert "1 of 10 samples" in why and "extreme value" in why
    constant = [np.append(b, [500.0] * 5) for b in background]
    why = scale_health.problem(_health(constant, 500 / 255), 500 / 255)
    assert "bands" in why and "constant" in why
