"""autoq.hessian: im2col against a loop convolution, H and the output-error identity."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from reference_ops import conv2d_loops

import autoq.hessian as Hm
from autoq.hessian import ConvGeometry, Hessian, conv_unfold, flatten_conv_weight, output_error

GEOMETRIES = {
    "plain 3x3": dict(c=3, o=4, k=(3, 3), strides=(1, 1), padding=(1, 1, 1, 1), groups=1),
    "stride 2, asymmetric pad": dict(c=2, o=3, k=(3, 2), strides=(2, 1), padding=(0, 1, 2, 0)),
    "dilation 2": dict(c=2, o=2, k=(2, 2), dilation=(2, 2)),
    "groups 2": dict(c=4, o=6, k=(3, 3), padding=(1, 1, 1, 1), groups=2),
    "depthwise 5x5 stride 2": dict(
        c=3, o=3, k=(5, 5), strides=(2, 2), padding=(2, 2, 2, 2), groups=3
    ),
    "1x1": dict(c=5, o=2, k=(1, 1)),
}


def _case(spec, seed=0, n=2, hw=(7, 6)):
    rng = np.random.default_rng(seed)
    geom = ConvGeometry(
        kernel=spec["k"],
        strides=spec.get("strides", (1, 1)),
        padding=spec.get("padding", (0, 0, 0, 0)),
        dilation=spec.get("dilation", (1, 1)),
        groups=spec.get("groups", 1),
    )
    x = rng.normal(size=(n, spec["c"], *hw))
    w = rng.normal(size=(spec["o"], spec["c"] // geom.groups, *spec["k"]))
    return geom, x, w


def _loop_conv(geom, x, w):
    return conv2d_loops(x, w, None, geom.strides, geom.padding, geom.dilation, geom.groups)


def test_doctests():
    res = doctest.testmod(Hm)
    assert res.attempted >= 5 and res.failed == 0


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_unfold_times_weight_is_the_convolution(name):
    geom, x, w = _case(GEOMETRIES[name])
    ref = _loop_conv(geom, x, w)
    patches = conv_unfold(x, geom)  # (G, N*OH*OW, K)
    wf = flatten_conv_weight(w, geom.groups)  # (G, O/G, K)
    y = np.matmul(patches, wf.transpose(0, 2, 1))  # (G, N*OH*OW, O/G)
    n, o, oh, ow = ref.shape
    y = y.reshape(geom.groups, n, oh, ow, o // geom.groups).transpose(1, 0, 4, 2, 3)
    np.testing.assert_allclose(y.reshape(ref.shape), ref, rtol=1e-12, atol=1e-12)
    # gathering a subset of the rows gives exactly those rows of the full unfold
    keep = Hm.even_rows(patches.shape[1], 7)
    np.testing.assert_array_equal(conv_unfold(x, geom, max_rows=7), patches[:, keep])


@pytest.mark.parametrize("name", ["plain 3x3", "groups 2", "depthwise 5x5 stride 2"])
def test_output_error_is_the_conv_output_mse(name):
    """tr(dW H dW^T) with H streamed over two batches == 2/n ||conv(x, dW)||^2 per channel
    (float32 data, as calibration feeds it; H's products are float32: rtol 1e-5)."""
    geom, x, w = _case(GEOMETRIES[name], seed=1, n=3)
    x = x.astype(np.float32)
    dw = np.random.default_rng(2).normal(size=w.shape) * 0.01
    h = Hessian.conv2d(geom, x.shape[1])
    h.update(x[:1])
    h.update(x[1:])
    err = output_error(flatten_conv_weight(dw, geom.groups), h.matrix()).reshape(-1)
    y = _loop_conv(geom, x, dw)
    rows = y.shape[0] * y.shape[2] * y.shape[3]
    ref = 2.0 / rows * (y**2).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(err, ref, rtol=1e-5)
    assert h.rows == rows
    # the mean patch gives the mean output of each channel
    mean_out = np.einsum("gok,gk->go", flatten_conv_weight(dw, geom.groups), h.mean()).reshape(-1)
    np.testing.assert_allclose(mean_out, y.mean(axis=(0, 2, 3)), rtol=1e-5, atol=1e-12)


def test_max_rows_keeps_evenly_spaced_rows():
    geom, x, _ = _case(GEOMETRIES["plain 3x3"], seed=5, n=1)
    x = x.astype(np.float32)  # H's products are float32 (float64 totals)
    full, sub = Hessian.conv2d(geom, 3), Hessian.conv2d(geom, 3, max_rows=10)
    full.update(x)
    sub.update(x)
    rows = conv_unfold(x, geom)[0]  # 42 rows
    keep = rows[np.linspace(0, len(rows) - 1, 10).round().astype(int)]
    assert sub.rows == 10 and full.rows == len(rows)
    keep = keep.astype(np.float64)
    np.testing.assert_allclose(sub.matrix()[0], 2 * keep.T @ keep / 10, rtol=1e-5)
    same = Hessian.conv2d(geom, 3, max_rows=1000)
    same.update(x)
    np.testing.assert_array_equal(same.matrix(), full.matrix())


def test_dense_hessian_and_errors():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5, 3)).astype(np.float32)  # leading axes are rows
    h = Hessian.dense(3)
    h.update(x)
    xs = x.reshape(-1, 3).astype(np.float64)
    np.testing.assert_allclose(h.matrix()[0], 2 * xs.T @ xs / 20, rtol=1e-5)
    with pytest.raises(ValueError, match="4 features, expected 3"):
        h.update(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="no data"):
        Hessian.dense(2).matrix()
    with pytest.raises(ValueError, match="do not split into 2 groups"):
        conv_unfold(np.zeros((1, 3, 4, 4)), ConvGeometry(kernel=1, groups=2))
    with pytest.raises(ValueError, match="padding"):
        ConvGeometry(kernel=1, padding=(1, 2, 3))


def test_buffered_products_equal_one_product_per_batch(monkeypatch):
    """Batches are buffered before one product (FLUSH_ELEMENTS): flushing after every
    batch gives the same H and mean, up to float32 products."""
    import autoq.hessian as hessian_mod

    geom, x, _ = _case(GEOMETRIES["plain 3x3"], seed=7, n=4)
    x = x.astype(np.float32)
    buffered = Hessian.conv2d(geom, x.shape[1])
    for i in range(4):
        buffered.update(x[i : i + 1])
    monkeypatch.setattr(hessian_mod, "FLUSH_ELEMENTS", 1)
    each = Hessian.conv2d(geom, x.shape[1])
    for i in range(4):
        each.update(x[i : i + 1])
        assert not each._pending
    assert buffered.rows == each.rows
    tol = 1e-6 * np.abs(each.matrix()).max()  # float32 products of cancelling terms
    np.testing.assert_allclose(buffered.matrix(), each.matrix(), rtol=1e-5, atol=tol)
    np.testing.assert_allclose(buffered.mean(), each.mean(), rtol=1e-6)


def test_elementwise_on_gathered_rows_equals_elementwise_on_the_input():
    """A fake quantization (0 -> 0) applied to the kept rows gives the H of the fake
    quantized input (zero padding included)."""
    from autoq import primitives as P

    geom, x, _ = _case(GEOMETRIES["plain 3x3"], seed=9, n=2)
    x = x.astype(np.float32)

    def fq(v):
        return P.dequantize(P.quantize(v, np.float32(0.05), 3), np.float32(0.05), 3)

    late, early = Hessian.conv2d(geom, 3, max_rows=20), Hessian.conv2d(geom, 3, max_rows=20)
    late.update(x, fq)
    early.update(fq(x))
    np.testing.assert_array_equal(late.matrix(), early.matrix())
    np.testing.assert_array_equal(late.mean(), early.mean())
