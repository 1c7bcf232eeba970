"""autoq.accuracy.hessian: im2col against a loop convolution, H and the output-error identity."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from reference_ops import conv2d_loops

import autoq.accuracy.hessian as Hm
from autoq.accuracy.hessian import (
    CodeHessian,
    ConvGeometry,
    Hessian,
    conv_unfold,
    flatten_conv_weight,
    output_error,
)

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
    """tr(dW H dW^T) with H streamed over two batches == 2/n ||conv(x, dW)||^2 per channel."""
    geom, x, w = _case(GEOMETRIES[name], seed=1, n=3)
    dw = np.random.default_rng(2).normal(size=w.shape) * 0.01
    h = Hessian.conv2d(geom, x.shape[1])
    h.update(x[:1])
    h.update(x[1:])
    err = output_error(flatten_conv_weight(dw, geom.groups), h.matrix()).reshape(-1)
    y = _loop_conv(geom, x, dw)
    rows = y.shape[0] * y.shape[2] * y.shape[3]
    ref = 2.0 / rows * (y**2).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(err, ref, rtol=1e-10)
    assert h.rows == rows
    # the mean patch gives the mean output of each channel
    mean_out = np.einsum("gok,gk->go", flatten_conv_weight(dw, geom.groups), h.mean()).reshape(-1)
    np.testing.assert_allclose(mean_out, y.mean(axis=(0, 2, 3)), rtol=1e-9, atol=1e-15)


def test_max_rows_keeps_evenly_spaced_rows():
    geom, x, _ = _case(GEOMETRIES["plain 3x3"], seed=5, n=1)
    full, sub = Hessian.conv2d(geom, 3), Hessian.conv2d(geom, 3, max_rows=10)
    full.update(x)
    sub.update(x)
    rows = conv_unfold(x, geom)[0]  # 42 rows
    keep = rows[np.linspace(0, len(rows) - 1, 10).round().astype(int)]
    assert sub.rows == 10 and full.rows == len(rows)
    np.testing.assert_allclose(sub.matrix()[0], 2 * keep.T @ keep / 10, rtol=1e-12)
    same = Hessian.conv2d(geom, 3, max_rows=1000)
    same.update(x)
    np.testing.assert_array_equal(same.matrix(), full.matrix())


def test_dense_hessian_and_errors():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 5, 3))  # leading axes are rows
    h = Hessian.dense(3)
    h.update(x)
    xs = x.reshape(-1, 3)
    np.testing.assert_allclose(h.matrix()[0], 2 * xs.T @ xs / 20, rtol=1e-12)
    with pytest.raises(ValueError, match="4 features, expected 3"):
        h.update(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="no data"):
        Hessian.dense(2).matrix()
    with pytest.raises(ValueError, match="do not split into 2 groups"):
        conv_unfold(np.zeros((1, 3, 4, 4)), ConvGeometry(kernel=1, groups=2))
    with pytest.raises(ValueError, match="padding"):
        ConvGeometry(kernel=1, padding=(1, 2, 3))


def _int_reference(rows: np.ndarray) -> np.ndarray:
    """sum of r r^T over the rows in Python integers (exact, no BLAS)."""
    r = rows.astype(object)
    return np.array([[[sum(a * b) for b in g.T] for a in g.T] for g in r], dtype=object)


@pytest.mark.parametrize("bound", [127, 4000, 30000], ids=["int8", "float32 1-row chunks", "int16"])
def test_code_hessian_is_exact_for_any_split_and_order(bound):
    """Integer codes: the int64 sums equal Python's exact integer sums (BLAS products in
    chunks that keep every partial sum exact), and shards merged in any order give the
    same bits as one pass; matrix()/mean() are the float Hessian of x = scale * codes."""
    geom = ConvGeometry(kernel=(3, 3), padding=(1, 1, 1, 1), groups=2)
    rng = np.random.default_rng(7)
    batches = [rng.integers(-bound, bound + 1, size=(1, 4, 5, 6)) for _ in range(6)]
    one = CodeHessian.conv2d(geom, 4, scale=0.25)
    for b in batches:
        one.update(b.astype(np.int16 if bound > 127 else np.int8))
    rows = np.concatenate([conv_unfold(b, geom) for b in batches], axis=1)
    one.flush()  # the rows are buffered until a full exact product (or matrix()/mean())
    assert one.rows == rows.shape[1] == 180
    assert (one.sum.astype(object) == _int_reference(rows)).all()
    np.testing.assert_array_equal(one.row_sum, rows.sum(axis=1))
    shards = [CodeHessian.conv2d(geom, 4, scale=0.25) for _ in range(3)]
    for k, b in enumerate(batches):  # round-robin, like a streamed distributed dataset
        shards[k % 3].update(b)
    merged = shards[2]
    merged.merge(shards[0])
    merged.merge(shards[1])
    assert merged.matrix().tobytes() == one.matrix().tobytes()
    assert merged.mean().tobytes() == one.mean().tobytes()
    ref = Hessian.conv2d(geom, 4)
    for b in batches:
        ref.update(0.25 * b.astype(np.float64))
    np.testing.assert_allclose(one.matrix(), ref.matrix(), rtol=1e-12)
    np.testing.assert_allclose(one.mean(), ref.mean(), rtol=1e-12)


def test_code_hessian_without_products_sums_the_same_rows():
    """``products=False``: the same row count, int64 row sums and mean as with the products
    (fed whole batches and gathered rows, merged from shards); no matrix; and it merges
    only with its own kind."""
    geom = ConvGeometry(kernel=(3, 3), padding=(1, 1, 1, 1))
    rng = np.random.default_rng(11)
    batches = [rng.integers(-128, 128, size=(1, 3, 5, 4)) for _ in range(5)]
    full = CodeHessian.conv2d(geom, 3, max_rows=7, scale=0.5)
    sums = [CodeHessian.conv2d(geom, 3, max_rows=7, scale=0.5, products=False) for _ in range(2)]
    for i, b in enumerate(batches):
        full.update(b)
        if i % 2:
            sums[1].update_rows(sums[1].rows_of(b, np.float32).transpose(0, 2, 1))
        else:
            sums[0].update(b)
    sums[0].merge(sums[1])
    assert sums[0].rows == full.rows == 35 and sums[0].sum is None
    np.testing.assert_array_equal(sums[0].row_sum, (full.flush(), full.row_sum)[1])
    assert sums[0].mean().tobytes() == full.mean().tobytes()
    with pytest.raises(ValueError, match="products=False"):
        sums[0].matrix()
    with pytest.raises(ValueError, match="cannot merge"):
        full.merge(sums[0])


def test_code_hessian_errors():
    h = CodeHessian.dense(3, scale=1.0)
    with pytest.raises(ValueError, match="integer codes"):
        h.update(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="no data"):
        h.matrix()
    h.update(np.ones((2, 3), np.int8))
    with pytest.raises(ValueError, match="cannot merge"):
        h.merge(CodeHessian.dense(3, scale=2.0))
    with pytest.raises(ValueError, match="positive"):
        CodeHessian.dense(3, scale=0.0)


def test_code_hessian_buffers_rows_while_the_product_stays_exact():
    """Rows are buffered while every column's sum of squares stays <= 2**24 (float32's
    exact integers): a column of 127s adds 30 * 127**2 = 483870 per 30-row batch, so 34
    batches are buffered and the 35th sends them to one product (the rest at matrix()).
    The int64 sums equal a flush after every batch; pickling (a shard's statistics) sends
    the sums."""
    import pickle

    rng = np.random.default_rng(11)
    batches = [rng.integers(-128, 128, size=(30, 5)).astype(np.int8) for _ in range(40)]
    for b in batches:
        b[:, 0] = 127
    buffered, each = CodeHessian.dense(5, scale=0.5), CodeHessian.dense(5, scale=0.5)
    for b in batches[:34]:
        buffered.update(b)
    assert buffered.sum is None and buffered.rows == 34 * 30
    buffered.update(batches[34])
    assert buffered.sum is not None and buffered.sum[0, 0, 0] == 34 * 30 * 127**2
    for b in batches[35:]:
        buffered.update(b)
    for b in batches:
        each.update(b)
        each.flush()
    back = pickle.loads(pickle.dumps(buffered))
    for h in (buffered, back):
        assert h.rows == 1200
        assert h.matrix().tobytes() == each.matrix().tobytes()
        np.testing.assert_array_equal(h.row_sum, each.row_sum)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block", [4, 5, Hm.GRAM_BLOCK])
def test_add_gram_is_the_full_product_bit_for_bit(dtype, block, monkeypatch):
    """The upper block rows, mirrored, add exactly the int64 of the full matmul (the plain
    numpy product), for widths that do and do not divide into blocks, several groups,
    a (G, K, rows) view that is not contiguous, onto any int64 sums already there."""
    monkeypatch.setattr(Hm, "GRAM_BLOCK", block)
    monkeypatch.setattr(Hm, "GRAM_MIN", 2 * block)
    rng = np.random.default_rng(13)
    bound = 15 if dtype == np.float32 else 30000  # products exact in the dtype
    for g, k, rows in [(1, 2 * block, 40), (2, 3 * block + 1, 33), (1, 2 * block - 1, 10)]:
        cols = rng.integers(-bound, bound + 1, size=(g, k, rows)).astype(dtype)
        start = rng.integers(-(2**40), 2**40, size=(g, k, k))
        start = start + start.transpose(0, 2, 1)
        ref = start + np.matmul(cols, cols.transpose(0, 2, 1)).astype(np.int64)
        for c in (cols, np.ascontiguousarray(cols.transpose(0, 2, 1)).transpose(0, 2, 1)):
            out = start.copy()
            Hm.add_gram(c, out)
            np.testing.assert_array_equal(out, ref)
    big = rng.integers(-255, 256, size=(1, 2 * block + 3, 250)).astype(np.float32)
    out = np.zeros((1, big.shape[1], big.shape[1]), np.int64)
    Hm.add_gram(big, out)  # int8 codes, 250 rows: below 2**24 per column, exact
    np.testing.assert_array_equal(out, np.matmul(big, big.transpose(0, 2, 1)).astype(np.int64))


def test_max_rows_gathers_patches_without_padding_the_input():
    """The kept rows are read from the input itself (taps in the padding 0): exactly the
    rows of the full unfold, for every geometry, row budget and a border-heavy image."""
    for name, spec in GEOMETRIES.items():
        geom, x, _ = _case(spec, seed=3, n=2, hw=(5, 4))
        full = conv_unfold(x, geom)
        for max_rows in (1, 2, 7, full.shape[1] - 1):
            keep = Hm.even_rows(full.shape[1], max_rows)
            np.testing.assert_array_equal(conv_unfold(x, geom, max_rows), full[:, keep], name)
        h = Hessian.conv2d(geom, x.shape[1], max_rows=7)
        assert h.rows_size(x.shape) == h.rows_of(x).size


@pytest.mark.parametrize("bound", [127, 30000], ids=["int8", "int16"])
def test_code_hessian_update_rows_equals_update(bound):
    """Rows gathered from a float input and quantized (quantize_offset) add the same int64
    sums as the whole input quantized (quantize - zero point) and then unfolded."""
    from autoq import primitives as P
    from autoq.accuracy.weight_tuning import quantize_offset

    dtype = "int8" if bound == 127 else "int16"
    geom = ConvGeometry(kernel=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1))
    rng = np.random.default_rng(17)
    scale, zp = 0.05 if bound == 127 else 0.0002, 3
    whole, rows = (CodeHessian.conv2d(geom, 4, max_rows=9, scale=scale) for _ in range(2))
    for _ in range(5):
        x = rng.normal(size=(1, 4, 9, 8)).astype(np.float32) * 4
        codes = P.quantize(x, scale, zp, dtype).astype(np.int32) - zp
        whole.update(codes)
        gathered = rows.rows_of(x, np.float32)
        rows.update_rows(quantize_offset(gathered, scale, zp, dtype).transpose(0, 2, 1))
    assert rows.rows == whole.rows == 45
    assert rows.matrix().tobytes() == whole.matrix().tobytes()
    np.testing.assert_array_equal(rows.row_sum, whole.row_sum)
    with pytest.raises(ValueError, match="integer codes"):
        rows.update_rows(np.full((1, 36, 2), 0.5, np.float32))
    with pytest.raises(ValueError, match="float"):
        rows.update_rows(np.zeros((1, 36, 2), np.int32))


def test_code_hessian_kept_rows_and_known_bound_give_the_exact_sums():
    """A large image whose kept patches (``max_rows``) are gathered from the integer codes
    first: the int64 sums equal Python's exact integers over those patches; rows given with
    a known code bound (skipping the integer check and the data's bound) add the same sums
    as rows checked and bounded from the data, also when the bound is far above the data's
    (int16-sized: products in float64 instead of float32); a nan among such rows is an
    error when they are summed."""
    geom = ConvGeometry(kernel=(3, 3), padding=(1, 1, 1, 1), groups=3)
    rng = np.random.default_rng(23)
    batches = [rng.integers(-128, 128, size=(1, 6, 12, 10)).astype(np.int32) for _ in range(3)]
    h = CodeHessian.conv2d(geom, 6, max_rows=17, scale=0.5)
    for b in batches:
        h.update(b)
    h.flush()
    rows = np.concatenate([conv_unfold(b, geom, max_rows=17) for b in batches], axis=1)
    assert h.rows == rows.shape[1] == 51
    assert (h.sum.astype(object) == _int_reference(rows)).all()
    np.testing.assert_array_equal(h.row_sum, rows.sum(axis=1))
    cols = rows.transpose(0, 2, 1).astype(np.float32)
    checked, known, wide = (CodeHessian.conv2d(geom, 6, max_rows=17) for _ in range(3))
    checked.update_rows(cols)
    known.update_rows(cols, bound=128)
    wide.update_rows(cols, bound=30000)
    for other in (known, wide):
        assert other.matrix().tobytes() == checked.matrix().tobytes()
        np.testing.assert_array_equal(other.row_sum, checked.row_sum)
    bad = cols.copy()
    bad[0, 0, 0] = np.nan
    broken = CodeHessian.conv2d(geom, 6, max_rows=17)
    broken.update_rows(bad, bound=128)
    with pytest.raises(ValueError, match="nan"):
        broken.flush()
