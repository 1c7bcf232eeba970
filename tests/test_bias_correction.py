"""autoq.accuracy.bias_correction: on a real int8 layer (integer accumulation in numpy int64), the
corrected int32 bias removes the per-channel mean shift to within half an accumulator step."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_ops import conv2d_loops

import autoq.accuracy.bias_correction as B
from autoq import primitives as P


def test_doctests():
    res = doctest.testmod(B)
    assert res.attempted >= 5 and res.failed == 0


def test_channel_mean_streams_like_numpy():
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(n, 3, 4, 5)) for n in (1, 2, 4)]
    m = B.ChannelMean(axis=1)
    for b in batches:
        m.update(b)
    ref = np.concatenate(batches).mean(axis=(0, 2, 3))
    np.testing.assert_allclose(m.mean(), ref, rtol=1e-12)
    dense = B.ChannelMean(axis=-1)
    dense.update(np.arange(6.0).reshape(3, 2))
    assert dense.mean().tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="2 channels, earlier batches had 3"):
        m.update(np.zeros((1, 2, 1, 1)))


def _int8_depthwise(x, w, b, s_x, s_w):
    """A depthwise 3x3 layer as the realized graph computes it: int8 input and weights,
    int32 bias, integer accumulation; returns the accumulator in real units."""
    xq = P.quantize(x, s_x, 0, "int8").astype(np.int64)
    wq = P.quantize(w, s_w, 0, "int8", axis=0).astype(np.int64)
    acc_scale = (np.float32(s_x) * s_w).astype(np.float32)
    bq = P.quantize_bias(b, s_x, s_w).values
    acc = np.rint(conv2d_loops(xq, wq, padding=(1, 1, 1, 1), groups=4)).astype(np.int64)
    return acc, bq, acc_scale


def test_correction_cancels_the_mean_shift_of_an_int8_depthwise_layer():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 1, 3, 3)) * np.array([1.0, 0.05, 0.3, 2.0]).reshape(-1, 1, 1, 1)
    b = rng.normal(size=4)
    x = np.abs(rng.normal(size=(8, 4, 6, 6))) + 0.5  # post-ReLU-like, non-zero mean
    s_x = np.float32(x.max() / 127)
    s_w = (np.abs(w).reshape(4, -1).max(axis=1) / 40).astype(np.float32)  # a coarse grid
    y_fp = conv2d_loops(x, w, b, padding=(1, 1, 1, 1), groups=4)
    acc, bq, acc_scale = _int8_depthwise(x, w, b, s_x, s_w)

    def mean_real(bias_q):
        return ((acc + bias_q.reshape(1, -1, 1, 1)) * acc_scale.reshape(1, -1, 1, 1)).mean(
            axis=(0, 2, 3)
        )

    m_fp = B.ChannelMean()
    m_fp.update(y_fp)
    shift = np.abs(m_fp.mean() - mean_real(bq))
    r = B.correct_bias(m_fp.mean(), mean_real(bq), acc_scale, bq)
    left = np.abs(m_fp.mean() - mean_real(r.values))
    assert r.values.dtype == np.int32 and r.saturated == 0
    assert np.all(left <= 0.5 * acc_scale + 1e-9)
    assert np.all(shift > 2 * acc_scale)  # the uncorrected layer was off by several steps
    # the bias never moves the other moments: the corrected outputs differ by a constant
    np.testing.assert_array_equal(r.values - bq, r.delta)


def test_errors():
    with pytest.raises(ValueError, match="positive"):
        B.correct_bias([1.0], [0.0], 0.0)
    with pytest.raises(ValueError, match="2 values for 1 channels"):
        B.correct_bias([1.0], [0.0], 1.0, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="no data"):
        B.ChannelMean().mean()


@pytest.mark.parametrize(
    "geom",
    [
        dict(kernel=3, padding=1),
        dict(kernel=(1, 3), strides=2, padding=(0, 1, 1, 0), dilation=(1, 2)),
        dict(kernel=3, padding=1, groups=4),
    ],
    ids=["3x3", "strided_dilated", "depthwise"],
)
def test_patch_mean_is_the_mean_of_every_im2col_patch(geom):
    """Streamed in batches and merged across two halves, PatchMean equals the mean of
    hessian.conv_unfold's patches (all output positions) in flatten_conv_weight's layout,
    so W_flat @ mean is the mean conv output."""
    from autoq.accuracy.hessian import ConvGeometry, conv_unfold, flatten_conv_weight

    g = ConvGeometry(**geom)
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(n, 4, 7, 6)) + 1.0 for n in (1, 2, 3)]
    ref = conv_unfold(np.concatenate(batches), g).mean(axis=1)
    a, b = B.PatchMean(g), B.PatchMean(g)
    a.update(batches[0])
    for x in batches[1:]:
        b.update(x)
    a.merge(b)
    np.testing.assert_allclose(a.mean(), ref, rtol=1e-12, atol=1e-12)
    w = rng.normal(size=(4, 4 // g.groups, *g.kernel))
    out = np.einsum("gok,gk->go", flatten_conv_weight(w, g.groups), a.mean()).reshape(-1)
    full = np.einsum("gok,gnk->gon", flatten_conv_weight(w, g.groups), conv_unfold(
        np.concatenate(batches), g)).reshape(4, -1).mean(axis=1)  # fmt: skip
    np.testing.assert_allclose(out, full, rtol=1e-10)
    with pytest.raises(ValueError, match="patch shape"):
        a.update(np.zeros((1, 8, 7, 6)))


@pytest.mark.parametrize(
    "geom",
    [
        dict(kernel=3, padding=1),
        dict(kernel=(3, 2), strides=(2, 1), padding=(0, 1, 2, 1), dilation=(2, 1)),
        dict(kernel=3, strides=2, padding=(1, 1, 0, 0), groups=4),
        dict(kernel=1),
        dict(kernel=1, strides=(2, 3), padding=(1, 0, 0, 2)),
    ],
    ids=["3x3", "strided_dilated_uneven_pad", "depthwise_stride2", "1x1", "1x1_strided_padded"],
)
def test_patch_sums_of_integer_codes_are_exact(geom):
    """Integer codes (a quantized input) take the matrix-product path: every tap's sum is
    the exact integer that a plain-loop convolution with a one-hot kernel gives, and the
    same float64 bits as the float path (tap by tap over the padded batch) on the same
    values, so the mean patches, and the corrected biases, do not move."""
    from autoq.accuracy.hessian import ConvGeometry

    g = ConvGeometry(**geom)
    rng = np.random.default_rng(2)
    codes = rng.integers(-128, 128, size=(2, 4, 9, 8)).astype(np.int32)
    sums, rows = B.PatchMean(g).sums(codes)
    (kh, kw), c = g.kernel, codes.shape[1]
    ref = np.zeros((c, kh, kw))
    for i in range(kh):
        for j in range(kw):
            one_hot = np.zeros((1, 1, kh, kw))
            one_hot[0, 0, i, j] = 1.0
            for ch in range(c):
                y = conv2d_loops(codes[:, ch : ch + 1], one_hot, None, g.strides, g.padding,
                                 g.dilation)  # fmt: skip
                ref[ch, i, j] = y.sum()
    assert rows == y.size  # every output position of every sample
    assert sums.dtype == np.float64 and np.array_equal(sums, ref.reshape(g.groups, -1))
    floats, float_rows = B.PatchMean(g).sums(codes.astype(np.float32))
    assert float_rows == rows and sums.tobytes() == floats.tobytes()
    # the same codes as float32 with their bound (weight tuning's quantize_offset codes):
    # the exact path (a float32 product, or a 1x1 kernel's strided slice), the same bits
    bounded, bounded_rows = B.PatchMean(g).sums(codes.astype(np.float32), bound=128)
    assert bounded_rows == rows and sums.tobytes() == bounded.tobytes()


def _tap_sums_padded(x, g):
    """Per channel and tap, the float64 sum over the output positions, the straightforward
    way: np.pad of the batch in float64, one strided slice per tap."""
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.strides, g.dilation
    top, left, bottom, right = g.padding
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    out = np.empty((x.shape[1], kh, kw))
    for i in range(kh):
        for j in range(kw):
            tap = xp[:, :, i * dh :: sh][:, :, :oh, j * dw :: sw][:, :, :, :ow]
            out[:, i, j] = tap.sum(axis=(0, 2, 3))
    return out.reshape(g.groups, -1), x.shape[0] * oh * ow


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 2), st.integers(1, 40), st.integers(1, 40), st.integers(1, 3),
    st.integers(1, 2), st.integers(0, 2), st.sampled_from([np.float32, np.float64]),
)  # fmt: skip
def test_float_patch_sums_are_the_padded_tap_sums_bit_for_bit(n, h, w, k, s, pad, dtype):
    """Float batches (any size, kernel, stride, padding): PatchMean's sums are, to the bit,
    the float64 sums of each tap's slice of the zero-padded batch."""
    from autoq.accuracy.hessian import ConvGeometry

    g = ConvGeometry(kernel=k, strides=s, padding=pad, groups=2)
    if h + 2 * pad < k or w + 2 * pad < k:
        return
    x = np.random.default_rng(h * 41 + w).normal(size=(n, 4, h, w)).astype(dtype) * 3.0
    sums, rows = B.PatchMean(g).sums(x)
    want, want_rows = _tap_sums_padded(x, g)
    assert rows == want_rows and sums.tobytes() == want.tobytes()
