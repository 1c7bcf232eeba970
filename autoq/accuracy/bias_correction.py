"""Empirical bias correction: remove the mean shift that quantization adds to a layer's output.

Rounding errors of the weights (and of the inputs, upstream) do not average out per output
channel: ``E[W~ x~] - E[W x]`` is a systematic, per-channel offset, and a depthwise layer's 9
weights per channel leave a large one (Nagel, van Baalen, Blankevoort, Welling 2019, "Data-Free
Quantization Through Weight Equalization and Bias Correction", sec. 4.2 and their empirical
variant; Finkelstein, Almog, Grobman 2019, "Fighting Quantization Bias With Bias"; Banner,
Nahshan, Soudry 2019, "Post training 4-bit quantization", sec. 4.3). The correction adds the
offset back to the bias, which for an integer layer is an int32 constant with scale
``acc_scale = s_x * s_w`` (per output channel):

    ``bias_q' = saturate_int32(bias_q + round((E[y_fp32] - E[y_q]) / acc_scale))``

``y`` is the layer's output *before* its activation (the accumulator, dequantized), per
output channel, averaged over the calibration data; ``E[y_q]`` is measured with the current
``bias_q``. With ``E[y_fp32]`` from the float model, the correction also absorbs the mean
error that arrives from upstream layers ("empirical" correction); with ``E[y_fp32]`` taken as
``W E[x~]`` on the quantized model's own inputs it removes only this layer's weight error.
The residual mean error after correction is at most half an accumulator step per channel.

``Config.bias_correction`` (:mod:`autoq.accuracy.weight_tuning`) applies the empirical form
to a conv/dense layer through its mean input patch: with ``m`` the fp32 model's mean patch
and ``m~`` the quantized-so-far model's (:class:`PatchMean`, exact over every output
position), ``E[y] - E[y~] = W m - W_q m~`` per output channel (the mean of a linear layer is
the layer of the mean), which covers both the layer's own weight error ``(W - W_q) m~`` and
the mean error its input brings from upstream, ``W (m - m~)``.

Pure numpy; :class:`ChannelMean` and :class:`PatchMean` stream batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoq import primitives as P

__all__ = ["BiasCorrection", "ChannelMean", "PatchMean", "correct_bias", "tap_reads", "tap_sums"]


class ChannelMean:
    """Streaming per-channel mean over every axis but ``axis`` (1 for NCHW, -1 for dense).

    >>> m = ChannelMean(axis=1)
    >>> m.update(np.array([[[1.0, 3.0], [0.0, 2.0]]]))     # N=1, C=2, 2 values each
    >>> m.update(np.array([[[5.0, 5.0], [4.0, 4.0]]]))
    >>> m.mean()
    array([3.5, 2.5])
    """

    def __init__(self, axis: int = 1):
        self.axis = axis
        self.sum: np.ndarray | None = None
        self.count = 0

    def update(self, y) -> None:
        y = np.moveaxis(np.asarray(y, np.float64), self.axis, 0)
        rows = y.reshape(y.shape[0], -1)
        if self.sum is None:
            self.sum = np.zeros(rows.shape[0])
        elif self.sum.shape[0] != rows.shape[0]:
            raise ValueError(f"{rows.shape[0]} channels, earlier batches had {self.sum.shape[0]}")
        self.sum += rows.sum(axis=1)
        self.count += rows.shape[1]

    def mean(self) -> np.ndarray:
        if self.sum is None or self.count == 0:
            raise ValueError("no data: call update() first")
        return self.sum / self.count


class PatchMean:
    """Streaming exact mean of a layer's input rows: a conv's im2col patches over every output
    position (``geom``: :class:`autoq.accuracy.hessian.ConvGeometry`, NCHW data) or a dense layer's
    rows (``geom`` None: every axis but the last). ``mean()`` is ``(G, K)`` in the layout of
    :func:`autoq.accuracy.hessian.flatten_conv_weight`, so ``W_flat[g] @ mean()[g]`` is the mean
    output of group ``g``'s channels without bias. Sums merge exactly (float64, any order of
    equal-size shards gives the same value up to float64 addition).

    A 1x1 image [[5]], 2x2 kernel, padding 1: each tap reads the pixel at one of the four
    output positions, so every tap's mean is 5 / 4:

    >>> from autoq.accuracy.hessian import ConvGeometry
    >>> m = PatchMean(ConvGeometry(kernel=2, padding=1))
    >>> m.update(np.array([[[[5.0]]]]))
    >>> m.mean()
    array([[1.25, 1.25, 1.25, 1.25]])

    Dense rows (two samples of 2 tokens):

    >>> d = PatchMean(None)
    >>> d.update(np.array([[[1.0, 2.0], [3.0, 4.0]]])); d.update(np.array([[[5.0, 6.0], [7.0, 8.0]]]))
    >>> d.mean()
    array([[4., 5.]])
    """

    def __init__(self, geom=None):
        self.geom = geom
        self.sum: np.ndarray | None = None
        self.count = 0

    def sums(self, x, bound: int | None = None) -> tuple[np.ndarray, int]:
        """One batch's ``(sums, rows)`` (what :meth:`update` adds; :meth:`add` takes them
        from elsewhere, e.g. a shard's per-sample sums added in dataset order). Integer data
        (a quantized input's codes: an integer dtype, or with ``bound`` integer values of
        magnitude at most ``bound`` in any dtype, e.g. the float32 codes of
        :func:`autoq.accuracy.weight_tuning.quantize_offset`) is summed exactly
        (:func:`tap_sums`), so the result does not depend on the order of the additions;
        float data tap by tap over the zero-padded batch in float64."""
        x = np.asarray(x)
        exact = bound is not None or x.dtype.kind in "iub"
        if self.geom is None:
            rows = x.reshape(-1, x.shape[-1])
            if exact:  # (integers: any order of the float64 additions gives the same sum)
                return rows.sum(axis=0, dtype=np.float64)[None], rows.shape[0]
            rows = np.asarray(rows, np.float64)
            return rows.sum(axis=0)[None], rows.shape[0]
        if x.ndim != 4:
            raise ValueError(f"PatchMean expects NCHW data, got shape {x.shape}")
        g = self.geom
        if exact:
            out, rows = tap_sums(x, g, bound)
            return out.reshape(g.groups, -1), rows
        (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.strides, g.dilation
        top, left, bottom, right = g.padding
        n, c, h, w = x.shape  # zero-padded in float64 in one pass (np.pad of a copy: two)
        if any(g.padding):
            xp = np.zeros((n, c, h + top + bottom, w + left + right))
            xp[:, :, top : top + h, left : left + w] = x
        else:  # (the same C-contiguous float64 array, without zeroing it first)
            xp = np.array(x, np.float64, order="C")
        oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
        ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
        out = np.empty((x.shape[1], kh, kw))
        for i in range(kh):
            for j in range(kw):
                r, q = i * dh, j * dw
                tap = xp[:, :, r : r + sh * (oh - 1) + 1 : sh, q : q + sw * (ow - 1) + 1 : sw]
                out[:, i, j] = tap.sum(axis=(0, 2, 3))
        return out.reshape(g.groups, -1), x.shape[0] * oh * ow

    def update(self, x, bound: int | None = None) -> None:
        """Add one batch (``bound``: see :meth:`sums`)."""
        self.add(*self.sums(x, bound))

    def add(self, sums: np.ndarray, n: int) -> None:
        if self.sum is not None and self.sum.shape != sums.shape:
            raise ValueError(f"patch shape {sums.shape}, earlier batches had {self.sum.shape}")
        self.sum = sums if self.sum is None else self.sum + sums
        self.count += n

    def merge(self, other: PatchMean) -> None:
        if other.sum is None:
            return
        if self.sum is None:
            self.sum, self.count = other.sum.copy(), other.count
            return
        self.sum = self.sum + other.sum
        self.count += other.count

    def mean(self) -> np.ndarray:
        if self.sum is None or self.count == 0:
            raise ValueError("no data: call update() first")
        return self.sum / self.count


def tap_reads(size: int, kernel: int, stride: int, dilation: int, before: int, after: int):
    """``(kernel, size)`` 0/1 float64 matrix along one spatial axis of a convolution:
    ``[i, r]`` is 1 when kernel tap ``i`` reads input position ``r`` at some output position
    (``before`` / ``after``: the zero padding on each side).

    Three inputs, kernel 3, stride 1, padding 1: tap 0 reads positions 0 and 1 (at output 0
    it reads the padding), tap 1 all three, tap 2 positions 1 and 2.

    >>> tap_reads(3, 3, 1, 1, 1, 1).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    """
    outputs = (size + before + after - dilation * (kernel - 1) - 1) // stride + 1
    out = np.zeros((kernel, size))
    for i in range(kernel):
        r = np.arange(outputs) * stride + i * dilation - before
        out[i, r[(r >= 0) & (r < size)]] = 1.0
    return out


def tap_sums(x: np.ndarray, geom, bound: int | None = None) -> tuple[np.ndarray, int]:
    """Per input channel and kernel tap, the sum over every output position of the
    (zero-padded) integer input the tap reads, ``(C, kh, kw)`` float64, and the number of
    output positions: :meth:`PatchMean.sums` of integer data, computed exactly as
    ``A_i @ x[n, c] @ B_j^T`` with the 0/1 matrices :func:`tap_reads` of the two axes (every
    partial sum is an integer below ``2**53``: the same float64 whatever the order of the
    additions). One matrix product over the batch instead of a pass per tap; in float32
    when every row's sum stays below ``2**24`` (its integers exact), and a 1x1 kernel's
    single tap summed from its strided slice directly. ``x``: an integer array, or integer
    values of magnitude at most ``bound`` in any dtype.

    The 1x1 image [[5]], 2x2 kernel, padding 1: each tap reads the pixel once.

    >>> from autoq.accuracy.hessian import ConvGeometry
    >>> s, n = tap_sums(np.array([[[[5]]]]), ConvGeometry(kernel=2, padding=1))
    >>> s.tolist(), n
    ([[[5.0, 5.0], [5.0, 5.0]]], 4)

    Float32 codes of magnitude at most 3 in 3 rows of [-1, 0, 1, 2, 3], 1x1 kernel, stride 2:
    rows 0 and 2, columns 0, 2 and 4 (-1 + 1 + 3, twice), at 6 output positions:

    >>> codes = np.arange(-1.0, 4.0, dtype=np.float32) * np.ones((1, 1, 3, 1), np.float32)
    >>> s, n = tap_sums(codes, ConvGeometry(kernel=1, strides=2), bound=3)
    >>> s.tolist(), n
    ([[[6.0]]], 6)
    """
    (kh, kw), (sh, sw), (dh, dw) = geom.kernel, geom.strides, geom.dilation
    top, left, bottom, right = geom.padding
    n, c, h, w = x.shape
    limit = 2.0**53 / max(n * h * w, 1)
    if bound is not None:
        big = int(bound)
    elif x.dtype.kind not in "iub":
        raise ValueError(f"tap_sums of {x.dtype} data needs the bound of its integer values")
    elif x.dtype.kind == "b" or max(-int(np.iinfo(x.dtype).min), np.iinfo(x.dtype).max) >= limit:
        big = max(-int(x.min(initial=0)), int(x.max(initial=0)))  # (else the dtype bounds it)
    else:
        big = max(-int(np.iinfo(x.dtype).min), np.iinfo(x.dtype).max)
    if big >= limit:
        raise ValueError("tap_sums: integer sums beyond 2**53 would not be exact in float64")
    a = tap_reads(h, kh, sh, dh, top, bottom)  # (kh, H)
    b = tap_reads(w, kw, sw, dw, left, right)  # (kw, W)
    oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (w + left + right - dw * (kw - 1) - 1) // sw + 1
    if kh == kw == 1:  # one tap: the positions it reads, every sh-th row and sw-th column
        read = x[:, :, _read_slice(a[0], sh)][:, :, :, _read_slice(b[0], sw)]
        return read.sum(axis=(0, 2, 3), dtype=np.float64).reshape(c, 1, 1), n * oh * ow
    dtype = np.float32 if big * w < 2**24 else np.float64  # |row sums| < 2**24: exact
    cols = x.reshape(-1, w).astype(dtype, copy=False) @ b.T.astype(dtype)  # (N*C*H, kw)
    out = np.einsum("ir,ncrj->cij", a, cols.astype(np.float64).reshape(n, c, h, kw))
    return out, n * oh * ow


def _read_slice(reads: np.ndarray, step: int) -> slice:
    """The positions a 0/1 row of :func:`tap_reads` marks (every ``step``-th from the
    first) as a slice."""
    at = np.flatnonzero(reads)
    return slice(int(at[0]), int(at[-1]) + 1, step) if at.size else slice(0, 0)


@dataclass(frozen=True)
class BiasCorrection:
    """``values``: the corrected int32 bias; ``delta``: what was added (int64, before
    saturation); ``saturated``: how many channels hit the int32 limits."""

    values: np.ndarray
    delta: np.ndarray
    saturated: int


def correct_bias(mean_fp32, mean_quant, acc_scale, bias_q=None) -> BiasCorrection:
    """The int32 bias that cancels the per-channel mean shift ``mean_fp32 - mean_quant``
    (real units) of a layer whose accumulator has scale ``acc_scale`` (scalar or per
    channel; ``s_x * s_w``). ``bias_q``: the current int32 bias (None = no bias: zeros).

    The float layer averages [1.0, -2.0], the int8 one [0.9, -2.06]; accumulator scale
    0.01: add 10 and 6 steps.

    >>> r = correct_bias([1.0, -2.0], [0.9, -2.06], 0.01, np.array([100, -3], np.int32))
    >>> r.values.tolist(), r.delta.tolist(), r.saturated
    ([110, 3], [10, 6], 0)

    A correction past int32 saturates and is counted:

    >>> correct_bias([1e9], [0.0], 1.0, np.array([2**31 - 100], np.int32)).saturated
    1
    """
    diff = np.asarray(mean_fp32, np.float64) - np.asarray(mean_quant, np.float64)
    scale = np.broadcast_to(np.asarray(acc_scale, np.float32), diff.shape).astype(np.float64)
    if np.any(~(scale > 0)) or diff.ndim != 1:
        raise ValueError("acc_scale must be positive; means must be 1-D (one per channel)")
    base = np.zeros(diff.shape, np.int64) if bias_q is None else np.asarray(bias_q, np.int64)
    if base.reshape(-1).shape != diff.shape:
        raise ValueError(f"bias has {base.size} values for {diff.size} channels")
    delta = np.rint(diff / scale).astype(np.int64)
    total = base.reshape(-1) + delta
    qmin, qmax = P.qrange("int32")
    saturated = int(np.count_nonzero((total < qmin) | (total > qmax)))
    values = np.clip(total, qmin, qmax).astype(np.int32).reshape(np.shape(base))
    return BiasCorrection(values, delta, saturated)
