"""Numeric primitives of affine quantization: pure numpy, no TVM.

Every function here is the single reference for one idea; the qnn ops' TVM legalizations,
the simulated graph and the realize stage must agree with these bit for bit, and the tests
check that they do.

Conventions (the same everywhere in autoq):

* real value ``r`` and integer ``q`` are related by ``r = (q - zero_point) * scale``;
* ``scale`` is float32, ``zero_point`` is int32, both scalars (per-tensor) or 1-D arrays
  (per-axis, with ``axis`` naming the dimension of the tensor they index);
* quantize is ``clip(round_half_to_even(float32(x) / scale) + zero_point, qmin, qmax)``, the
  exact arithmetic of ONNX QuantizeLinear and of Relax ``R.quantize`` (division, not
  multiplication by a reciprocal: the two differ in the last bit, pytorch/ao#229).

The worked examples below run as doctests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "INT_RANGES",
    "ROUNDING_MODES",
    "BiasQuantization",
    "choose_qparams",
    "dequantize",
    "elementwise",
    "elementwise_accumulator",
    "elementwise_multipliers",
    "fixed_point_multiply",
    "qrange",
    "quantize",
    "quantize_bias",
    "quantize_multiplier",
    "requantize",
    "round_half",
    "rounding_right_shift",
    "simulate_accumulator",
]

Rounding = Literal["float", "half_even", "half_away", "half_up", "tflite", "tflite_single"]

#: Requantize rounding modes. ``float`` computes in float32 exactly like
#: ``quantize(dequantize(x))`` and is the mode whose results the simulated graph predicts
#: bit for bit. The others are integer-only (int32 multiplier and shift, int64 product):
#: ``half_even`` / ``half_away`` / ``half_up`` round the product with that tie rule
#: (``half_up`` is old TVM's "UPWARD", ties toward +inf); ``tflite`` is TFLite/gemmlowp's
#: ``MultiplyByQuantizedMultiplier`` (saturating rounding doubling high multiply, then a
#: rounding divide by a power of two: two roundings); ``tflite_single`` is TFLite's single
#: rounding variant (one rounding of the 64-bit product, ties toward +inf).
ROUNDING_MODES: tuple[str, ...] = (
    "float",
    "half_even",
    "half_away",
    "half_up",
    "tflite",
    "tflite_single",
)

#: ``(qmin, qmax)`` of every integer dtype autoq quantizes to (see :func:`qrange`).
INT_RANGES = {
    "int4": (-8, 7),
    "uint4": (0, 15),
    "int8": (-128, 127),
    "uint8": (0, 255),
    "int16": (-32768, 32767),
    "uint16": (0, 65535),
    "int32": (-(2**31), 2**31 - 1),
}


def qrange(dtype: str, narrow_range: bool = False, reduce_range: bool = False) -> tuple[int, int]:
    """Integer range ``(qmin, qmax)`` of a quantized dtype.

    ``narrow_range`` drops the most negative value of a signed type so that the range is
    symmetric (int8 -> [-127, 127]); ``reduce_range`` uses one bit less (int8 -> [-64, 63],
    uint8 -> [0, 127]), the classic fix for int16 saturation in x86 u8s8 kernels.

    >>> qrange("int8"), qrange("int8", narrow_range=True), qrange("uint8", reduce_range=True)
    ((-128, 127), (-127, 127), (0, 127))
    >>> qrange("int8", narrow_range=True, reduce_range=True)
    (-63, 63)
    >>> qrange("float16")
    Traceback (most recent call last):
    ...
    ValueError: unsupported quantized dtype 'float16'; expected one of int4, uint4, int8, uint8, int16, uint16, int32
    """
    if dtype not in INT_RANGES:
        raise ValueError(
            f"unsupported quantized dtype {dtype!r}; expected one of {', '.join(INT_RANGES)}"
        )
    qmin, qmax = INT_RANGES[dtype]
    if reduce_range:
        qmin, qmax = qmin // 2, qmax // 2
    if narrow_range and qmin < 0:
        qmin = -qmax
    return qmin, qmax


def all_codes(dtype: str) -> np.ndarray:
    """Every code of the integer ``dtype``, ascending, as ``dtype`` (the tables of 8-bit
    lookups and the exhaustive checks of their requantizes index them in this order).

    >>> all_codes("int8")[[0, 128, 255]].tolist(), all_codes("uint8")[[0, 255]].tolist()
    ([-128, 0, 127], [0, 255])
    """
    lo, hi = qrange(dtype)
    return np.arange(lo, hi + 1).astype(dtype)


def _as_f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def choose_qparams(
    rmin: ArrayLike,
    rmax: ArrayLike,
    dtype: str = "int8",
    symmetric: bool = False,
    narrow_range: bool = False,
    reduce_range: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point that map the real range ``[rmin, rmax]`` onto ``dtype``.

    ``rmin``/``rmax`` are scalars (per-tensor) or equal-length 1-D arrays (per-channel); the
    result has the same shape: ``scale`` float32, ``zero_point`` int32. The range is first
    widened to include 0 so that 0.0 is exactly representable (zero padding, ReLU).

    * asymmetric: ``scale = (rmax - rmin) / (qmax - qmin)``,
      ``zero_point = clip(qmin - round_half_even(rmin / scale), qmin, qmax)``;
    * symmetric: ``scale = max(|rmin|, |rmax|) / ((qmax - qmin) / 2)`` and the zero point is the
      middle of the range (0 for signed types, 128 for uint8). With the full int8 range the
      divisor is 127.5 (PyTorch's convention); with ``narrow_range`` it is 127 (ONNX Runtime's).
    * degenerate ranges (all-zero tensor, or a range so small that the scale would be below
      the smallest normal float32) get ``scale = 1`` and the zero point that maps 0 exactly,
      never a division by zero.

    Worked examples (int8, asymmetric): the range [-1, 3] spans 4.0 over 255 steps, so
    ``scale = 4/255 = 0.015686...`` and ``zero_point = -128 - round(-1 / scale)
    = -128 - round(-63.75) = -128 + 64 = -64``:

    >>> s, z = choose_qparams(-1.0, 3.0)
    >>> float(s), int(z)
    (0.01568627543747425, -64)

    A ReLU output [0, 6] in uint8: ``scale = 6/255``, ``zero_point = 0``. A positive-only
    range is widened to include 0 first ([2, 6] behaves as [0, 6]):

    >>> [(round(float(s), 6), int(z)) for s, z in
    ...  [choose_qparams(0.0, 6.0, "uint8"), choose_qparams(2.0, 6.0, "uint8")]]
    [(0.023529, 0), (0.023529, 0)]

    Symmetric int8, full range vs narrow range, for amax = 2.54:

    >>> [round(float(choose_qparams(-2.54, 1.0, symmetric=True, narrow_range=n)[0]), 6)
    ...  for n in (False, True)]
    [0.019922, 0.02]

    Per-channel (two channels, one of them all-zero: it gets scale 1, not a NaN):

    >>> s, z = choose_qparams(np.array([-0.5, 0.0]), np.array([0.25, 0.0]), symmetric=True,
    ...                       narrow_range=True)
    >>> s.tolist(), z.tolist()
    ([0.003937007859349251, 1.0], [0, 0])

    Symmetric uint8 puts the zero point in the middle:

    >>> int(choose_qparams(-1.0, 1.0, "uint8", symmetric=True)[1])
    128
    """
    qmin, qmax = qrange(dtype, narrow_range, reduce_range)
    rmin = np.minimum(np.asarray(rmin, dtype=np.float64), 0.0)
    rmax = np.maximum(np.asarray(rmax, dtype=np.float64), 0.0)
    if rmin.shape != rmax.shape:
        raise ValueError(
            f"rmin and rmax must have the same shape, got {rmin.shape} and {rmax.shape}"
        )
    if not (np.all(np.isfinite(rmin)) and np.all(np.isfinite(rmax))):
        raise ValueError("cannot choose quantization parameters for a range with NaN or Inf")
    if symmetric:
        amax = np.maximum(-rmin, rmax)
        scale = (amax / ((qmax - qmin) / 2.0)).astype(np.float32)
        mid = (qmin + qmax + 1) // 2
        zero_point = np.full(scale.shape, mid, dtype=np.int32)
    else:
        scale = ((rmax - rmin) / float(qmax - qmin)).astype(np.float32)
        safe = np.where(scale < np.finfo(np.float32).tiny, np.float32(1.0), scale)
        zp = qmin - np.rint(rmin.astype(np.float32) / safe)
        zero_point = np.clip(zp, qmin, qmax).astype(np.int32)
    return _unit_scale_if_degenerate(scale, zero_point, qmin, qmax, symmetric)


def _unit_scale_if_degenerate(scale, zero_point, qmin: int, qmax: int, symmetric: bool):
    """Scale 1 (and the zero point that maps 0 exactly) where the scale is below the smallest
    normal float32: an all-zero tensor or channel never divides by zero."""
    degenerate = scale < np.finfo(np.float32).tiny
    if np.any(degenerate):
        scale = np.where(degenerate, np.float32(1.0), scale).astype(np.float32)
        # symmetric keeps the middle of the range (zero point 128 for uint8, like the other
        # channels); asymmetric takes 0 (or the nearest value of the range)
        zp0 = (qmin + qmax + 1) // 2 if symmetric else int(np.clip(0, qmin, qmax))
        zero_point = np.where(degenerate, np.int32(zp0), zero_point)
        zero_point = zero_point.astype(np.int32)
    return scale.astype(np.float32), zero_point.astype(np.int32)


def _broadcast_param(p, ndim: int, axis: int | None) -> np.ndarray:
    """Reshape a per-axis parameter so that it broadcasts along ``axis`` of an ndim tensor."""
    p = np.asarray(p)
    if p.ndim == 0 or axis is None:
        if p.ndim > 0 and p.size != 1:
            raise ValueError(f"a per-axis parameter of length {p.size} needs an axis")
        return p.reshape(()) if p.size == 1 else p
    axis = axis % ndim
    shape = [1] * ndim
    shape[axis] = p.size
    return p.reshape(shape)


def quantize(x, scale, zero_point, dtype: str = "int8", axis: int | None = None) -> np.ndarray:
    """``clip(round_half_even(float32(x) / scale) + zero_point, qmin, qmax)`` as ``dtype``.

    Ties go to even, as in ONNX QuantizeLinear: with scale 0.5, 0.25 -> 0.5 -> 0 (not 1),
    0.75 -> 1.5 -> 2, 1.25 -> 2.5 -> 2, -0.25 -> -0.5 -> -0; then ``+ zero_point`` 1.
    Values beyond the range saturate:

    >>> quantize(np.array([0.25, 0.75, 1.25, -0.25, 100.0, -100.0]), 0.5, 1)
    array([   1,    3,    3,    1,  127, -128], dtype=int8)

    Per-axis (axis 0 of a 2x2 weight, scales 0.1 and 0.01):

    >>> quantize(np.array([[0.1, -0.2], [0.1, -0.2]]), np.array([0.1, 0.01]), 0, axis=0)
    array([[  1,  -2],
           [ 10, -20]], dtype=int8)
    """
    qmin, qmax = qrange(dtype)
    x = _as_f32(x)
    s = _broadcast_param(_as_f32(scale), x.ndim, axis)
    z = _broadcast_param(np.asarray(zero_point, dtype=np.int32), x.ndim, axis).astype(np.float32)
    q = np.rint(x / s) + z
    # clip in float64: exact for every dtype, and float32 cannot hold int32's qmax 2**31 - 1
    # (its float32 neighbour 2**31 would overflow the cast to int32)
    return np.clip(q.astype(np.float64), qmin, qmax).astype(dtype)


def dequantize(q, scale, zero_point, axis: int | None = None) -> np.ndarray:
    """``float32(q - zero_point) * scale`` (subtract in int32, then one float32 multiply).

    >>> dequantize(np.array([-128, 0, 127], dtype=np.int8), 0.5, -128)
    array([  0. ,  64. , 127.5], dtype=float32)
    """
    q = np.asarray(q)
    s = _broadcast_param(_as_f32(scale), q.ndim, axis)
    z = _broadcast_param(np.asarray(zero_point, dtype=np.int32), q.ndim, axis)
    diff = q.astype(np.int64) - z.astype(np.int64)
    return (diff.astype(np.float32) * s).astype(np.float32)


def round_half(x, mode: str = "half_even") -> np.ndarray:
    """Round float64 values to integers with an explicit tie rule.

    >>> x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5])
    >>> round_half(x, "half_even").tolist()
    [-2.0, -2.0, -0.0, 0.0, 2.0, 2.0]
    >>> round_half(x, "half_away").tolist()
    [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0]
    >>> round_half(x, "half_up").tolist()
    [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0]
    """
    x = np.asarray(x, dtype=np.float64)
    if mode == "half_even":
        return np.rint(x)
    if mode == "half_away":
        return np.sign(x) * np.floor(np.abs(x) + 0.5)
    if mode == "half_up":
        return np.floor(x + 0.5)
    raise ValueError(f"unknown tie rule {mode!r}; expected half_even, half_away or half_up")


def rounding_right_shift(x, shift, mode: str = "half_even") -> np.ndarray:
    """Exact ``round(x / 2**shift)`` on int64 with a tie rule, in integer arithmetic only.

    ``shift`` may be an array (per-channel) and must be >= 0.

    >>> rounding_right_shift(np.array([5, 6, 7, -5, -6, -7]), 2, "half_even").tolist()
    [1, 2, 2, -1, -2, -2]
    >>> rounding_right_shift(np.array([6, -6, 2, -2]), 2, "half_away").tolist()
    [2, -2, 1, -1]
    >>> rounding_right_shift(np.array([6, -6, 2, -2]), 2, "half_up").tolist()
    [2, -1, 1, 0]
    """
    x = np.asarray(x, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    if np.any(shift < 0):
        raise ValueError("rounding_right_shift needs shift >= 0")
    shift = np.minimum(shift, 62)
    one = np.int64(1)
    floor = x >> shift
    rem = x - (floor << shift)  # in [0, 2**shift)
    half = np.where(shift > 0, one << np.maximum(shift - 1, 0), 0)
    if mode == "half_up":
        up = rem >= half
    elif mode == "half_away":
        up = (rem > half) | ((rem == half) & (x >= 0))
    elif mode == "half_even":
        up = (rem > half) | ((rem == half) & ((floor & 1) == 1))
    else:
        raise ValueError(f"unknown tie rule {mode!r}; expected half_even, half_away or half_up")
    up = up & (shift > 0)
    return floor + up.astype(np.int64)


def quantize_multiplier(real_multiplier) -> tuple[np.ndarray, np.ndarray]:
    """Integer multiplier and shift with ``m * 2**(shift - 31) ~= real_multiplier``.

    ``m`` is an int32 in ``[2**30, 2**31)`` (0 for a zero multiplier) and ``shift`` the
    power-of-two exponent (positive = left shift), as TFLite's ``QuantizeMultiplier``:
    ``real = frac * 2**shift`` with ``frac`` in [0.5, 1), ``m = round(frac * 2**31)``.

    0.75 = 0.75 * 2**0 -> m = 0.75 * 2**31 = 1610612736, shift 0;
    0.1 = 0.8 * 2**-3 -> m = round(0.8 * 2**31) = 1717986918, shift -3:

    >>> m, s = quantize_multiplier(np.array([0.75, 0.1, 2.0]))
    >>> m.tolist(), s.tolist()
    ([1610612736, 1717986918, 1073741824], [0, -3, 2])
    """
    real = np.asarray(real_multiplier, dtype=np.float64)
    if np.any(real < 0) or not np.all(np.isfinite(real)):
        raise ValueError("a requantize multiplier must be finite and >= 0")
    frac, exp = np.frexp(real)
    m = np.rint(frac * 2.0**31).astype(np.int64)
    carry = m == 2**31
    m = np.where(carry, m // 2, m)
    exp = np.where(carry, exp + 1, exp)
    # multipliers too small to matter become 0 (the product rounds to 0 anyway)
    tiny = exp < -31
    m = np.where(tiny | (real == 0), 0, m)
    exp = np.where(tiny | (real == 0), 0, exp)
    return m.astype(np.int32), exp.astype(np.int32)


def _srdhm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """gemmlowp SaturatingRoundingDoublingHighMul on int32 values held in int64."""
    overflow = (a == -(2**31)) & (b == -(2**31))
    ab = a.astype(object) * b.astype(object)  # exact: up to 2**62
    ab = np.asarray(ab, dtype=np.int64)
    nudge = np.where(ab >= 0, np.int64(1 << 30), np.int64(1 - (1 << 30)))
    # gemmlowp divides (ab + nudge) by 2**31 truncating toward zero
    num = ab + nudge
    q = np.where(num >= 0, num >> 31, -((-num) >> 31))
    return np.where(overflow, np.int64(2**31 - 1), q)


def fixed_point_multiply(x, multiplier, shift, rounding: str = "tflite") -> np.ndarray:
    """``x * multiplier * 2**(shift - 31)`` rounded to an integer, integer arithmetic only.

    ``x``: int32 values (e.g. an accumulator minus its zero point); ``multiplier``/``shift``
    from :func:`quantize_multiplier` (per-element broadcastable arrays). Rounding modes:
    ``tflite`` (gemmlowp double rounding), ``tflite_single`` (one rounding, ties toward +inf),
    ``half_even``, ``half_away``, ``half_up`` (one exact rounding of the int64 product).

    x = 15, multiplier 0.5 (m = 2**30, shift 0): 7.5 is an exact tie and every mode gives 8;
    -7.5 shows the modes apart. gemmlowp's doubling high multiply adds ``1 - 2**30`` to
    negative products before a division that truncates toward zero, so its negative ties
    go toward zero (-7), like ``half_up``; ``half_even`` and ``half_away`` give -8.
    13 * 0.5 = 6.5 separates half-even (6) from half-away (7):

    >>> m, s = quantize_multiplier(0.5)
    >>> [int(fixed_point_multiply(15, m, s, r)) for r in
    ...  ("tflite", "tflite_single", "half_even", "half_away", "half_up")]
    [8, 8, 8, 8, 8]
    >>> [int(fixed_point_multiply(-15, m, s, r)) for r in
    ...  ("tflite", "tflite_single", "half_even", "half_away", "half_up")]
    [-7, -7, -8, -8, -7]
    >>> [int(fixed_point_multiply(13, m, s, r)) for r in ("half_even", "half_away")]
    [6, 7]
    """
    x = np.asarray(x, dtype=np.int64)
    m = np.asarray(multiplier, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    if rounding == "tflite":
        left = np.maximum(shift, 0)
        right = np.maximum(-shift, 0)
        xs = np.clip(x << left, -(2**31), 2**31 - 1)
        # then gemmlowp's RoundingDivideByPOT: round to nearest, ties away from zero
        return rounding_right_shift(_srdhm(xs, np.broadcast_to(m, xs.shape)), right, "half_away")
    total = 31 - shift
    prod = x * m  # |x| < 2**31, m < 2**31: exact in int64
    if rounding == "tflite_single":
        rounding = "half_up"
    if np.any(total < 0):
        # multiplier >= 2**31: shift left instead
        left = np.maximum(-total, 0)
        return np.where(
            total < 0, prod << left, rounding_right_shift(prod, np.maximum(total, 0), rounding)
        )
    return rounding_right_shift(prod, total, rounding)


def requantize(
    q,
    in_scale,
    in_zero_point,
    out_scale,
    out_zero_point,
    dtype: str = "int8",
    rounding: str = "float",
    axis: int | None = None,
) -> np.ndarray:
    """Re-express integers ``q`` (scale ``in_scale``) with ``out_scale`` / ``out_zero_point``.

    ``rounding="float"`` is exactly ``quantize(dequantize(q, in_scale, in_zp), out_scale,
    out_zp)`` in float32: the default, and what the simulated graph predicts bit for bit.
    The integer modes use ``multiplier = in_scale / out_scale`` (float64) turned into an
    int32 multiplier and shift (:func:`quantize_multiplier`), then
    :func:`fixed_point_multiply`, ``+ out_zero_point`` and saturation. ``in_scale`` may be
    per-axis (a conv's ``input_scale * weight_scale``).

    An int32 accumulator of 1000 at scale 0.001 (1.0) to scale 0.02 is 50, then
    ``+ zero_point`` 3 -> 53. Accumulators 5 and -5 with ratio 0.5 are the ties 2.5 and -2.5:
    float (half-even) gives 2/-2, half-away 3/-3, half-up 3/-2, and TFLite's double rounding
    3/-2 (its negative ties go toward zero, see :func:`fixed_point_multiply`):

    >>> requantize(np.array([1000], np.int32), 0.001, 0, 0.02, 3).tolist()
    [53]
    >>> [requantize(np.array([5, -5], np.int32), 0.5, 0, 1.0, 0, rounding=r).tolist()
    ...  for r in ("float", "half_even", "half_away", "half_up", "tflite")]
    [[2, -2], [2, -2], [3, -3], [3, -2], [3, -2]]
    """
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode {rounding!r}; expected one of {ROUNDING_MODES}")
    q = np.asarray(q)
    if rounding == "float":
        return quantize(
            dequantize(q, in_scale, in_zero_point, axis), out_scale, out_zero_point, dtype, axis
        )
    qmin, qmax = qrange(dtype)
    in_scale = _as_f32(in_scale).astype(np.float64)
    out_scale = _as_f32(out_scale).astype(np.float64)
    m, shift = quantize_multiplier(in_scale / out_scale)
    m = _broadcast_param(m, q.ndim, axis)
    shift = _broadcast_param(shift, q.ndim, axis)
    zin = _broadcast_param(np.asarray(in_zero_point, np.int64), q.ndim, axis)
    zout = _broadcast_param(np.asarray(out_zero_point, np.int64), q.ndim, axis)
    y = fixed_point_multiply(q.astype(np.int64) - zin, m, shift, rounding) + zout
    return np.clip(y, qmin, qmax).astype(dtype)


_ELEMENTWISE = {
    "add": lambda x, y: x + y,
    "subtract": lambda x, y: x - y,
    "multiply": lambda x, y: x * y,
}


def elementwise_multipliers(kind: str, lhs_scale, rhs_scale, out_scale) -> tuple[int, int, int]:
    """Integer multipliers ``(ma, mb)`` and one common right ``shift`` for integer-only
    add / subtract / multiply (see :func:`elementwise`).

    add/subtract: ``ma ~= lhs_scale / out_scale * 2**shift``, ``mb ~= rhs_scale / out_scale
    * 2**shift``; multiply: ``ma ~= lhs_scale * rhs_scale / out_scale * 2**shift``, ``mb = 0``.
    ``shift`` is chosen so that the larger multiplier has 31 significant bits.

    >>> elementwise_multipliers("add", 0.5, 0.25, 1.0)
    (1073741824, 536870912, 31)
    >>> elementwise_multipliers("multiply", 0.5, 0.25, 1.0)
    (1073741824, 0, 33)
    """
    sa, sb, so = (float(np.float32(v)) for v in (lhs_scale, rhs_scale, out_scale))
    if kind == "multiply":
        reals = [sa * sb / so, 0.0]
    elif kind in ("add", "subtract"):
        reals = [sa / so, sb / so]
    else:
        raise ValueError(f"unknown elementwise op {kind!r}; expected add, subtract or multiply")
    _, exp = np.frexp(max(reals))
    shift = 31 - int(exp)
    ms = [round(r * 2.0**shift) for r in reals]
    if max(ms) >= 2**31:
        shift -= 1
        ms = [round(r * 2.0**shift) for r in reals]
    if not 0 <= shift <= 62:
        raise ValueError(f"scale ratio {max(reals)} is out of the range integer {kind} supports")
    return int(ms[0]), int(ms[1]), shift


def elementwise_accumulator(kind: str, da, db, ma: int, mb: int, const=np.int64):
    """What integer-only add / subtract / multiply round: ``da * ma +/- db * mb`` or
    ``da * db * ma``; ``da``/``db`` are the operands minus their zero points, ``ma``/``mb`` from
    :func:`elementwise_multipliers`. ``const`` makes the int64 multipliers (numpy here, a TIR
    constant in the ``qnn`` legalization: both build the same expression).

    >>> da, db = np.array([2, -3]), np.array([4, 5])
    >>> [elementwise_accumulator(k, da, db, 3, 2).tolist() for k in ("add", "subtract", "multiply")]
    [[14, 1], [-2, -19], [24, -45]]
    """
    if kind == "multiply":
        return da * db * const(ma)
    sign = 1 if kind == "add" else -1
    return da * const(ma) + db * const(sign * mb)


def elementwise(
    kind: str,
    lhs,
    lhs_scale,
    lhs_zero_point,
    rhs,
    rhs_scale,
    rhs_zero_point,
    out_scale,
    out_zero_point,
    dtype: str = "int8",
    rounding: str = "float",
) -> np.ndarray:
    """Reference for ``qnn.add`` / ``qnn.subtract`` / ``qnn.multiply`` (per-tensor qparams).

    ``float``: ``quantize(dequantize(lhs) op dequantize(rhs))`` in float32. Integer modes:
    ``out_zp + round(((lhs - zl) * ma op (rhs - zr) * mb) / 2**shift)`` (add/subtract) or
    ``out_zp + round((lhs - zl) * (rhs - zr) * ma / 2**shift)`` (multiply), one rounding with
    the mode's tie rule (``tflite_single``: up), with multipliers from
    :func:`elementwise_multipliers`. ``tflite`` follows TFLite's kernel instead:
    :func:`autoq.qnn.tflite_arith.elementwise`.

    0.5 * (3 - 1) + 0.25 * (2 - 0) = 1.5 at output scale 1.0 is a tie:

    >>> [int(elementwise("add", 3, 0.5, 1, 2, 0.25, 0, 1.0, 0, rounding=r))
    ...  for r in ("float", "half_away", "half_up")]
    [2, 2, 2]
    >>> [int(elementwise("subtract", 1, 0.5, 0, 4, 0.5, 0, 1.0, 0, rounding=r))
    ...  for r in ("float", "half_even", "half_away", "half_up")]
    [-2, -2, -2, -1]
    """
    if rounding not in ROUNDING_MODES or rounding == "tflite":
        raise ValueError(
            f"unknown rounding mode {rounding!r} here: expected float, half_even, half_away, "
            "half_up or tflite_single (ties up); tflite: autoq.qnn.tflite_arith.elementwise"
        )
    fn = _ELEMENTWISE[kind]
    if rounding == "float":
        real = fn(
            dequantize(lhs, lhs_scale, lhs_zero_point), dequantize(rhs, rhs_scale, rhs_zero_point)
        )
        return quantize(real, out_scale, out_zero_point, dtype)
    ma, mb, shift = elementwise_multipliers(kind, lhs_scale, rhs_scale, out_scale)
    da = np.asarray(lhs, np.int64) - np.int64(lhs_zero_point)
    db = np.asarray(rhs, np.int64) - np.int64(rhs_zero_point)
    acc = elementwise_accumulator(kind, da, db, ma, mb)
    tie = "half_up" if rounding == "tflite_single" else rounding
    y = rounding_right_shift(acc, shift, tie) + np.int64(out_zero_point)
    qmin, qmax = qrange(dtype)
    return np.clip(y, qmin, qmax).astype(dtype)


@dataclass(frozen=True)
class BiasQuantization:
    """Result of :func:`quantize_bias`: the int32 bias, its scale, and how many saturated."""

    values: np.ndarray
    scale: np.ndarray
    saturated: int


def quantize_bias(bias, input_scale, weight_scale) -> BiasQuantization:
    """Quantize a float bias to int32 with ``scale = input_scale * weight_scale`` and zp 0.

    The product is computed in float32 (the same rounding as in the graph) and per channel
    when ``weight_scale`` is per-channel. Values beyond int32 saturate and are *counted* in
    ``saturated`` so that the caller can report them instead of failing silently.

    >>> r = quantize_bias(np.array([0.5, -0.25, 1e9]), 0.5, np.array([0.01, 0.01, 0.01]))
    >>> r.values.tolist(), r.saturated
    ([100, -50, 2147483647], 1)
    """
    bias = np.asarray(bias, dtype=np.float32)
    scale = (_as_f32(input_scale) * _as_f32(weight_scale)).astype(np.float32)
    s = scale if scale.ndim == 0 else scale.reshape(bias.shape[:1] + (1,) * (bias.ndim - 1))
    safe = np.where(s == 0, np.float32(1.0), s)
    real = np.rint(bias / safe).astype(np.float64)
    qmin, qmax = qrange("int32")
    saturated = int(np.count_nonzero((real < qmin) | (real > qmax)))
    values = np.clip(real, qmin, qmax).astype(np.int32)
    return BiasQuantization(values=values, scale=scale, saturated=saturated)


def simulate_accumulator(x, bits: int, overflow: str = "saturate") -> np.ndarray:
    """What an accumulator of ``bits`` signed bits holds: saturate or wrap (two's complement).

    >>> simulate_accumulator(np.array([40000, -40000, 100]), 16, "saturate").tolist()
    [32767, -32768, 100]
    >>> simulate_accumulator(np.array([40000, -40000, 100]), 16, "wrap").tolist()
    [-25536, 25536, 100]
    """
    if not 2 <= bits <= 32:
        raise ValueError(f"accumulator bits must be in [2, 32], got {bits}")
    x = np.asarray(x, dtype=np.int64)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if overflow == "saturate":
        return np.clip(x, lo, hi)
    if overflow == "wrap":
        return ((x - lo) % (2**bits)) + lo
    raise ValueError(f"unknown overflow mode {overflow!r}; expected 'saturate' or 'wrap'")


def fma_float32(a, b, c) -> np.ndarray:
    """float32 ``a * b + c`` with one rounding (to nearest, ties to even), like a hardware
    FMA; finite results only.

    The product of two float32 is exact in float64; the float64 sum's rounding error is
    recovered exactly (TwoSum) and breaks the tie when the float64 sum lands on the midpoint
    of two float32, where rounding twice would differ from rounding once.

    >>> a = np.float32(1 + 2**-12)  # a * a = 1 + 2**-11 + 2**-24: exactly a float32 midpoint
    >>> bool(fma_float32(a, a, np.float32(-1)) == 2**-11 + 2**-24)  # exact in float32
    True
    >>> bool(fma_float32(a, a, np.float32(0)) == 1 + 2**-11)  # the tie, to even
    True
    >>> bool(fma_float32(a, a, np.float32(2**-60)) == 1 + 2**-11 + 2**-23)  # just above it
    True
    """
    p = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32)
    c = np.asarray(c, np.float32).astype(np.float64)
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)  # s + err == p + c exactly
    out = s.astype(np.float32)
    near = out.astype(np.float64)
    toward = np.where(s > near, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    other = np.nextafter(out, toward).astype(np.float64)
    tie = (s != near) & (s - near == other - s) & (err != 0)
    # on a midpoint the float64 sum had the tie; the exact sum is on err's side of it
    up = np.where(err > 0, np.maximum(near, other), np.minimum(near, other))
    return np.where(tie, up, out).astype(np.float32)


#: the range of scales :func:`reciprocal_division_steps` accepts: x = n * s_in (|n| < 2**33)
#: divided by s_out stays away from float32 underflow and overflow at every step
RECIPROCAL_SCALE_RANGE = (2.0**-60, 2.0**60)


def reciprocal_division_steps(divisor, dividend_scale) -> int:
    """How many FMA corrections make ``x * RN(1 / divisor)`` equal to float32 ``x / divisor``
    for every ``x = float32(n * dividend_scale)``, n an integer with ``|n| < 2**33`` (a
    requantize: an int32 accumulator times its scale, divided by the output scale); 0 when
    the scales leave that range (keep the division). Scalars or per-channel arrays: the
    largest count over them.

    With ``r = RN(1/s)`` (|r s - 1| <= 2**-24), ``y = RN(x r)``, a correction is ``e =
    fma(-y, s, x)``, ``y' = fma(e, r, y)``. Markstein's theorem: if y is faithful (one of
    the two float32 around x/s) and r = RN(1/s), y' = RN(x/s) (e is then exact). y = RN(x r)
    is faithful when ``|r s - 1| <= 2**-25``: ``|x r - x/s| < ulp(x/s) / 2`` then. Else one
    correction gives a faithful y' (its error is |x/s - y| * 2**-22 ulp at most, far below
    half an ulp) and a second one the exact quotient. The conditions outside the theorem's
    (no underflow or overflow of y, e and y', e exact) hold for both scales (and their
    ratio) in ``[2**-60, 2**60]``: |x| >= 2**-60 unless 0, |x / s| in [2**-121, 2**94].

    >>> reciprocal_division_steps(np.float32(0.5), np.float32(1e-4))  # r = 2 exact
    1
    >>> reciprocal_division_steps(np.float32(1.99999988), np.float32(1e-4))  # r s = 1 + 2**-24
    2
    >>> reciprocal_division_steps(np.float32(0.02), np.float32(1e-30))
    0
    """
    s = np.asarray(divisor, np.float32).astype(np.float64).reshape(-1)
    si = np.asarray(dividend_scale, np.float32).astype(np.float64).reshape(-1)
    lo, hi = RECIPROCAL_SCALE_RANGE
    ratio = si / s  # with both broadcast: per-channel rows have the same length
    for v in (s, si, ratio):
        if not np.all((v >= lo) & (v <= hi)):
            return 0
    r = (np.float32(1) / s.astype(np.float32)).astype(np.float64)  # RN(1/s)
    err = np.abs(r * s - 1.0)  # r * s exact in float64 (24 x 24 bits)
    return 1 if np.all(err <= 2.0**-25) else 2


def divide_by_reciprocal(x, divisor, reciprocal, steps: int) -> np.ndarray:
    """float32 ``x / divisor`` as ``x * reciprocal`` plus ``steps`` FMA corrections (see
    :func:`reciprocal_division_steps`); ``reciprocal`` is float32 ``RN(1 / divisor)``.

    >>> s = np.float32(0.1)
    >>> x = np.float32(1.3)
    >>> r = np.float32(1) / s
    >>> bool(x * r == x / s), bool(divide_by_reciprocal(x, s, r, 1) == x / s)
    (False, True)
    """
    x = np.asarray(x, np.float32)
    s = np.asarray(divisor, np.float32)
    r = np.asarray(reciprocal, np.float32)
    y = (x * r).astype(np.float32)
    for _ in range(steps):
        e = fma_float32(-y, s, x)
        y = fma_float32(e, r, y)
    return y


def code_division_steps(divisor, dividend_scale, zero_point, dtype: str) -> int:
    """:func:`reciprocal_division_steps` for the requantize of ``dtype`` codes (8-bit, not
    an accumulator): ``x = dequantize(q, dividend_scale, zero_point)`` takes one value per
    code, so where the general bound asks for two corrections, one is enough when it gives
    float32 ``x / divisor`` for every code (checked on all of them, every channel of a
    per-channel ``divisor``); else the general count.

    >>> s = np.float32(1.99999988)  # r s = 1 + 2**-24: the general bound needs 2
    >>> reciprocal_division_steps(s, np.float32(1e-4)), code_division_steps(s, 1e-4, -3, "int8")
    (2, 1)
    """
    steps = reciprocal_division_steps(divisor, dividend_scale)
    if steps != 2:
        return steps
    x = dequantize(all_codes(dtype), dividend_scale, zero_point)[:, None]
    return 1 if division_steps_on(x, np.asarray(divisor).reshape(1, -1)) == 1 else 2


def division_steps_on(x, divisor) -> int:
    """The fewest FMA corrections (1 or 2) after ``x * RN(1 / divisor)`` that give float32
    ``x / divisor`` for every value of the finite set ``x`` (float32, broadcast against
    ``divisor``; each checked), or 0 when two are not enough (then divide).

    >>> x = np.arange(-255, 256).astype(np.float32) * np.float32(0.02)
    >>> division_steps_on(x, np.float32(0.1)), division_steps_on(x, np.float32(0))
    (1, 0)
    """
    x = np.asarray(x, np.float32)
    s = np.asarray(divisor, np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        want = (x / s).astype(np.float32)
    if not (np.all(np.isfinite(want)) and np.all(s > 0)):
        return 0
    r = np.float32(1) / s
    for steps in (1, 2):
        if np.array_equal(divide_by_reciprocal(x, s, r, steps), want):
            return steps
    return 0
