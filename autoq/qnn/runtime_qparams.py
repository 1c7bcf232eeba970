"""Numeric reference of dynamic quantization: qparams computed at run time from the tensor
itself (pure numpy, no TVM). ``qnn.dynamic_quantize`` (:mod:`autoq.qnn.dynamic_quantize`)
computes exactly this, bit for bit, inside the graph.

Everything is float32 arithmetic, in this order (the order fixes the last bit):

* ``rmin = min(0, min(x))``, ``rmax = max(0, max(x))`` over the whole tensor
  (``granularity="tensor"``) or over the last axis (``"token"``: one pair per row, kept as
  a trailing axis of length 1 so that it broadcasts);
* asymmetric: ``scale = (rmax - rmin) / float32(qmax - qmin)``,
  ``zero_point = clip(qmin - round_half_even(rmin / scale), qmin, qmax)``;
* symmetric: ``scale = max(-rmin, rmax) / float32((qmax - qmin) / 2)``, zero point the
  middle of the range (0 for int8, 128 for uint8);
* a scale below the smallest normal float32 (an all-zero row) becomes 1, never a division
  by zero (the zero point formula then gives qmin, which still represents 0.0 exactly);
* ``q = clip(round_half_even(x / scale) + zero_point, qmin, qmax)``
  (:func:`autoq.primitives.quantize`).

With uint8 and asymmetric this is ONNX ``DynamicQuantizeLinear``.
"""

from __future__ import annotations

import numpy as np

from autoq import primitives as P

__all__ = ["dynamic_dense", "dynamic_qparams", "dynamic_quantize"]

_F32 = np.float32


def dynamic_qparams(
    x,
    granularity: str = "tensor",
    dtype: str = "int8",
    symmetric: bool = False,
    narrow_range: bool = False,
    reduce_range: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Run-time ``(scale, zero_point)`` of ``x`` (see the module docstring): 0-d for
    ``"tensor"``, shape ``x.shape[:-1] + (1,)`` for ``"token"``.

    Worked example (int8, asymmetric): the tensor [-1, 0.5, 3] spans [-1, 3], so
    ``scale = 4 / 255 = 0.0156863`` and ``zero_point = -128 - round(-1 / scale)
    = -128 - round(-63.75) = -64``:

    >>> s, z = dynamic_qparams(np.array([-1.0, 0.5, 3.0]))
    >>> float(s), int(z)
    (0.01568627543747425, -64)

    Per token, two rows; the all-zero row gets scale 1 (and zero point qmin = 0):

    >>> s, z = dynamic_qparams(np.array([[0.0, 2.55], [0.0, 0.0]]), "token", "uint8")
    >>> s.ravel().tolist(), z.ravel().tolist()
    ([0.009999999776482582, 1.0], [0, 0])

    Symmetric int8 (narrow range): ``scale = 2.54 / 127 = 0.02``, zero point 0:

    >>> s, z = dynamic_qparams(np.array([-2.54, 1.0]), symmetric=True, narrow_range=True)
    >>> round(float(s), 6), int(z)
    (0.02, 0)
    """
    qmin, qmax = P.qrange(dtype, narrow_range, reduce_range)
    x = np.asarray(x, _F32)
    if granularity == "token":
        lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    elif granularity == "tensor":
        lo, hi = x.min(), x.max()
    else:
        raise ValueError(f"granularity must be 'tensor' or 'token', got {granularity!r}")
    rmin = np.minimum(lo, _F32(0)).astype(_F32)
    rmax = np.maximum(hi, _F32(0)).astype(_F32)
    if symmetric:
        scale = (np.maximum(-rmin, rmax) / _F32((qmax - qmin) / 2)).astype(_F32)
    else:
        scale = ((rmax - rmin) / _F32(qmax - qmin)).astype(_F32)
    scale = np.where(scale < np.finfo(_F32).tiny, _F32(1), scale).astype(_F32)
    if symmetric:
        zp = np.full(scale.shape, (qmin + qmax + 1) // 2, np.int32)
    else:
        zp = np.clip(_F32(qmin) - np.rint(rmin / scale), qmin, qmax).astype(np.int32)
    return scale, zp


def dynamic_quantize(x, granularity: str = "tensor", dtype: str = "int8", **range_options):
    """``(q, scale, zero_point)``: ``x`` quantized with its own run-time qparams
    (:func:`dynamic_qparams`; ``range_options``: symmetric, narrow_range, reduce_range).

    >>> q, s, z = dynamic_quantize(np.array([[-1.0, 0.5, 3.0]]), "token")
    >>> q.tolist(), int(z.ravel()[0])
    ([[-128, -32, 127]], -64)
    """
    s, z = dynamic_qparams(x, granularity, dtype, **range_options)
    x = np.asarray(x, _F32)
    qmin, qmax = P.qrange(dtype)
    q = np.rint(x / s) + z.astype(_F32)
    return np.clip(q, qmin, qmax).astype(dtype), s, z


def dynamic_dense(x, weight_q, weight_scale, bias=None, granularity="tensor", **spec):
    """Float32 ``x @ W.T (+ bias)`` the way a dynamic layer computes it: ``x`` quantized at
    run time, ``weight_q`` ``[N, K]`` int8 with symmetric per-channel (``[N]``) or scalar
    ``weight_scale``, an exact integer accumulator, then
    ``float32(acc) * (scale_x * scale_w)`` and the float bias. ``spec``: dtype, symmetric,
    narrow_range, reduce_range of the activations.

    Worked example: ``x = [0, 2.55]`` gets ``scale = 2.55 / 255 = 0.01`` and zero point
    -128, so ``q - zp = [0, 255]``; the accumulator is ``[255 * -127, 255 * 64]
    = [-32385, 16320]``, times ``0.01 * [0.01, 0.02]``:

    >>> w = np.array([[127, -127], [0, 64]], np.int8)
    >>> dynamic_dense(np.array([[0.0, 2.55]]), w, np.array([0.01, 0.02], np.float32))
    array([[-3.2384999,  3.264    ]], dtype=float32)
    """
    q, s, z = dynamic_quantize(x, granularity, **spec)
    acc = (q.astype(np.int64) - z) @ weight_q.astype(np.int64).T
    y = acc.astype(_F32) * (s * np.asarray(weight_scale, _F32)).astype(_F32)
    if bias is not None:
        y = y + np.asarray(bias, _F32)
    return y.astype(_F32)
