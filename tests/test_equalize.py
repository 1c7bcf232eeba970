"""autoq.equalize: the float function is unchanged (loop convolution reference), the ranges
become equal, high-bias absorption narrows the activation without changing the output."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from reference_ops import conv2d_loops

import autoq.equalize as E

PAD1 = (1, 1, 1, 1)


def _uneven_conv(rng, o, c, k, groups=1):
    """Weights whose output channels differ in range by up to 100x (what DFQ fixes)."""
    w = rng.normal(size=(o, c // groups, k, k))
    return w * np.logspace(-1, 1, o)[rng.permutation(o)].reshape(-1, 1, 1, 1)


def _net(x, w1, b1, w2, b2, g1, g2, lo=0.0, hi=np.inf, pad2=PAD1):
    """conv(w1, pad 1) -> clip(lo, hi) per channel -> conv(w2, pad2)."""
    z = conv2d_loops(x, w1, b1, padding=PAD1, groups=g1)
    a = np.clip(z, np.reshape(lo, (1, -1, 1, 1)), np.reshape(hi, (1, -1, 1, 1)))
    return conv2d_loops(a, w2, b2, padding=pad2, groups=g2), z


def test_doctests():
    res = doctest.testmod(E)
    assert res.attempted >= 8 and res.failed == 0


@pytest.mark.parametrize(
    "g1,g2", [(1, 1), (6, 1), (1, 6)], ids=["conv-conv", "depthwise-conv", "conv-depthwise"]
)
def test_equalization_preserves_conv_relu_conv(g1, g2):
    rng = np.random.default_rng(0)
    c_in, c = (6, 6) if g1 == 6 else (3, 6)
    w1, b1 = _uneven_conv(rng, c, c_in, 3, g1), rng.normal(size=c)
    w2, b2 = (
        rng.normal(size=(c if g2 == 6 else 4, c // g2, 3, 3)),
        rng.normal(size=c if g2 == 6 else 4),
    )
    x = rng.normal(size=(2, c_in, 5, 5))
    ref, _ = _net(x, w1, b1, w2, b2, g1, g2)
    s = E.equalization_scales(E.output_channel_ranges(w1), E.input_channel_ranges(w2, g2))
    w1e, b1e, w2e = E.apply_equalization(w1, b1, w2, s, groups2=g2)
    got, _ = _net(x, w1e, b1e, w2e, b2, g1, g2)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(
        E.output_channel_ranges(w1e), E.input_channel_ranges(w2e, g2), rtol=1e-12
    )
    np.testing.assert_allclose(
        E.output_channel_ranges(w1e),
        np.sqrt(E.output_channel_ranges(w1) * E.input_channel_ranges(w2, g2)),
    )


def test_relu6_stays_exact_with_scaled_bounds():
    rng = np.random.default_rng(1)
    w1, b1 = _uneven_conv(rng, 4, 3, 3), rng.normal(size=4)
    w2 = rng.normal(size=(2, 4, 1, 1))
    x = 3 * rng.normal(size=(2, 3, 5, 5))
    ref, z = _net(x, w1, b1, w2, None, 1, 1, 0.0, 6.0, pad2=(0,) * 4)
    assert np.any(z > 6.0) and np.any(z < 0.0)  # both bounds are active
    s = E.equalization_scales(E.output_channel_ranges(w1), E.input_channel_ranges(w2))
    w1e, b1e, w2e = E.apply_equalization(w1, b1, w2, s)
    lo, hi = E.scaled_bounds(0.0, 6.0, s)
    got, _ = _net(x, w1e, b1e, w2e, None, 1, 1, lo, hi, pad2=(0,) * 4)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)
    wrong, _ = _net(x, w1e, b1e, w2e, None, 1, 1, 0.0, 6.0, pad2=(0,) * 4)
    assert not np.allclose(wrong, ref)  # a per-tensor ReLU6 after scaling is not the same model


def test_chain_through_a_depthwise_layer_converges_and_is_exact():
    """1x1 expand -> relu -> depthwise 3x3 -> relu -> 1x1 project (a MobileNetV2 block)."""
    rng = np.random.default_rng(2)
    w = [
        _uneven_conv(rng, 8, 4, 1),
        _uneven_conv(rng, 8, 8, 3, groups=8),
        rng.normal(size=(3, 8, 1, 1)),
    ]
    b = [rng.normal(size=8), rng.normal(size=8), None]
    x = rng.normal(size=(2, 4, 5, 5))

    def run(ws, bs):
        a = np.maximum(conv2d_loops(x, ws[0], bs[0]), 0)
        a = np.maximum(conv2d_loops(a, ws[1], bs[1], padding=PAD1, groups=8), 0)
        return conv2d_loops(a, ws[2], bs[2])

    ws, bs, scales = E.equalize_chain(w, b, groups=[1, 8, 1], iterations=100, tol=1e-10)
    np.testing.assert_allclose(run(ws, bs), run(w, b), rtol=1e-9, atol=1e-9)
    for k in range(2):  # converged: every pair is equalized
        np.testing.assert_allclose(
            E.output_channel_ranges(ws[k]),
            E.input_channel_ranges(ws[k + 1], [1, 8, 1][k + 1]),
            rtol=1e-6,
        )
    spread = [np.ptp(np.log(E.output_channel_ranges(v))) for v in (w[1], ws[1])]
    assert spread[1] < 0.75 * spread[0]  # the depthwise channel ranges are far more even
    assert len(scales) == 2 and scales[0].shape == (8,)


def test_high_bias_absorption_is_exact_and_narrows_the_activation():
    rng = np.random.default_rng(3)
    w1 = rng.normal(size=(5, 3, 3, 3)) * 0.2
    b1 = np.array([8.0, 5.0, 0.5, -1.0, 12.0])  # large positive biases: z stays far above 0
    w2, b2 = rng.normal(size=(4, 5, 1, 1)), rng.normal(size=4)
    x = rng.normal(size=(3, 3, 6, 6))
    for hi in (np.inf, 15.0):  # relu, and a clip whose bound moves with c
        ref, z = _net(x, w1, b1, w2, b2, 1, 1, 0.0, hi, pad2=(0,) * 4)
        zc = z.transpose(1, 0, 2, 3).reshape(5, -1)
        c = E.high_bias_amount(zc.mean(1), zc.std(1), minimum=zc.min(1))
        assert c[0] > 4 and c[4] > 7 and c[3] == 0.0
        b1a, b2a = E.absorb_high_bias(b1, w2, b2, c)
        got, za = _net(x, w1, b1a, w2, b2a, 1, 1, 0.0, hi - c, pad2=(0,) * 4)
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)
        # the quantized range of the activation is [0, max]: the max drops by c
        before = np.clip(z, 0, hi).max(axis=(0, 2, 3))
        after = np.clip(za, 0, np.reshape(hi - c, (1, -1, 1, 1))).max(axis=(0, 2, 3))
        np.testing.assert_allclose(after, before - c, rtol=1e-12)
        assert after[4] < 0.5 * before[4]


def test_absorption_into_a_grouped_layer_and_errors():
    w2 = np.arange(8.0).reshape(4, 1, 1, 2)  # depthwise-like, groups 4, two taps each
    b1, b2 = E.absorb_high_bias(np.ones(4), w2, np.zeros(4), np.array([1.0, 0, 0, 2.0]), groups2=4)
    assert b1.tolist() == [0.0, 1.0, 1.0, -1.0]
    assert b2.tolist() == [1.0, 0.0, 0.0, 2 * (6 + 7)]
    with pytest.raises(ValueError, match="3 scales for 2 output channels"):
        E.apply_equalization(np.ones((2, 1)), None, np.ones((1, 2)), np.ones(3))
    with pytest.raises(ValueError, match="at least two layers"):
        E.equalize_chain([np.ones((2, 2))], [None], [1])
