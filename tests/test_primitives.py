"""autoq.primitives: golden vectors worked out by hand, properties against exact references.

The golden vectors are written inline with the reasoning in a comment next to each edge
case. The property tests compare against exact arithmetic: Python ints and
``fractions.Fraction`` (no floating point in the references, except for the float32 values
that are the inputs themselves).
"""

from __future__ import annotations

import doctest
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import autoq.primitives as P
import autoq.qnn.tflite_arith as TA

F32 = np.float32
SETTINGS = settings(max_examples=300, deadline=None)


def test_doctests():
    res = doctest.testmod(P, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 30
    assert res.failed == 0


# ------------------------------------------------------------------ exact helpers


def round_fraction(v: Fraction, rule: str) -> int:
    """Exact rounding of a rational with a tie rule (no floating point)."""
    fl = v.numerator // v.denominator  # floor
    rem = v - fl  # in [0, 1)
    half = Fraction(1, 2)
    if rem > half:
        return fl + 1
    if rem < half:
        return fl
    # an exact tie
    if rule == "half_even":
        return fl + (fl & 1)
    if rule == "half_away":
        return fl + 1 if v > 0 else fl
    if rule == "half_up":
        return fl + 1
    raise ValueError(rule)


def dist_to_tie(v: Fraction) -> Fraction:
    """Distance of v from the nearest k + 1/2."""
    r = v - (v.numerator // v.denominator)
    return abs(r - Fraction(1, 2))


def gemmlowp_srdhm(a: int, b: int) -> int:
    """gemmlowp SaturatingRoundingDoublingHighMul, transcribed on Python ints."""
    if a == b == -(2**31):
        return 2**31 - 1
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    num = ab + nudge
    # C++ integer division truncates toward zero
    q = abs(num) // (1 << 31)
    return q if num >= 0 else -q


def gemmlowp_rdbpot(x: int, exponent: int) -> int:
    """gemmlowp RoundingDivideByPOT (mask / threshold formulation)."""
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def tflite_multiply(x: int, m: int, shift: int) -> int:
    """TFLite MultiplyByQuantizedMultiplier (double rounding); the left shift saturates to
    int32 as in autoq (TFLite leaves an overflow undefined)."""
    left = max(shift, 0)
    right = max(-shift, 0)
    xs = min(max(x * (1 << left), -(2**31)), 2**31 - 1)
    return gemmlowp_rdbpot(gemmlowp_srdhm(xs, m), right)


def tflite_single_multiply(x: int, m: int, shift: int) -> int:
    """TFLite's TFLITE_SINGLE_ROUNDING MultiplyByQuantizedMultiplier."""
    total = 31 - shift
    if total <= 0:
        return x * m << -total
    return (x * m + (1 << (total - 1))) >> total


def exact_multiply(x: int, m: int, shift: int, rule: str) -> int:
    return round_fraction(Fraction(x * m) * Fraction(2) ** (shift - 31), rule)


def fq(v) -> Fraction:
    """The exact rational value of a float (float32 values convert exactly)."""
    return Fraction(float(v))


# -------------------------------------------------------------------------- qrange


@pytest.mark.parametrize(
    "dtype,narrow,reduce,expected",
    [
        ("int8", False, False, (-128, 127)),
        ("int8", True, False, (-127, 127)),  # symmetric range for symmetric weights
        ("int8", False, True, (-64, 63)),  # one bit less (x86 u8s8 int16 saturation)
        ("int8", True, True, (-63, 63)),
        ("uint8", False, False, (0, 255)),
        ("uint8", True, False, (0, 255)),  # narrow range only affects signed types
        ("uint8", False, True, (0, 127)),
        ("int16", False, False, (-32768, 32767)),
        ("int16", True, False, (-32767, 32767)),
        ("int16", False, True, (-16384, 16383)),
        ("uint16", False, False, (0, 65535)),
        ("int4", False, False, (-8, 7)),
        ("uint4", False, False, (0, 15)),
        ("int32", False, False, (-(2**31), 2**31 - 1)),
        ("int32", True, False, (-(2**31) + 1, 2**31 - 1)),
    ],
)
def test_qrange(dtype, narrow, reduce, expected):
    assert P.qrange(dtype, narrow, reduce) == expected


@pytest.mark.parametrize("dtype", ["float16", "float32", "int64", "bool", "int"])
def test_qrange_rejects_other_dtypes(dtype):
    with pytest.raises(ValueError, match=f"unsupported quantized dtype '{dtype}'"):
        P.qrange(dtype)


# ------------------------------------------------------------------ choose_qparams


def test_choose_qparams_asymmetric_golden():
    # [-1, 3] on int8: scale = 4/255 (float32), zp = -128 - round(-1 / scale)
    # = -128 - round(-63.75) = -128 + 64 = -64 (a negative zero point)
    s, z = P.choose_qparams(-1.0, 3.0)
    assert s.dtype == np.float32 and z.dtype == np.int32
    assert s == F32(4.0 / 255.0) and z == -64
    # uint8, same range: zp = 0 - round(-63.75) = 64
    s, z = P.choose_qparams(-1.0, 3.0, "uint8")
    assert s == F32(4.0 / 255.0) and z == 64
    # a ReLU range [0, 6]: zp = qmin (real 0 maps to the lowest integer)
    assert P.choose_qparams(0.0, 6.0, "uint8") == (F32(6.0 / 255.0), 0)
    assert P.choose_qparams(0.0, 6.0, "int8") == (F32(6.0 / 255.0), -128)
    # an all-negative range [-6, -2] is widened to [-6, 0]: zp = -128 + 255 = 127 = qmax
    s, z = P.choose_qparams(-6.0, -2.0)
    assert s == F32(6.0 / 255.0) and z == 127
    # a positive-only range [2, 6] is widened to [0, 6] (0 must be exact)
    assert P.choose_qparams(2.0, 6.0, "uint8") == P.choose_qparams(0.0, 6.0, "uint8")
    # reduce_range: int8 [-64, 63] has 127 steps: scale 4/127, zp = -64 - round(-31.75) = -32
    s, z = P.choose_qparams(-1.0, 3.0, reduce_range=True)
    assert s == F32(4.0 / 127.0) and z == -32
    # int16: 65535 steps, zp = -32768 - round(-1 / (4/65535)) = -32768 + 16384 = -16384
    s, z = P.choose_qparams(-1.0, 3.0, "int16")
    assert s == F32(4.0 / 65535.0) and z == -16384
    # the zero point rounds half to even: a range of 255 * 2**-4 on uint8 has the exact
    # scale 2**-4, and rmin = -8.5 * 2**-4 gives rmin / scale = -8.5 -> -8 -> zp 8 (half
    # away from zero would give 9); rmin = -9.5 * 2**-4 -> -10 -> zp 10
    for rmin, zp in ((-8.5 / 16, 8), (-9.5 / 16, 10)):
        s, z = P.choose_qparams(rmin, rmin + 255 / 16, "uint8")
        assert s == F32(1 / 16) and z == zp


def test_choose_qparams_symmetric_golden():
    # full int8 range: divisor (127 - -128) / 2 = 127.5 (PyTorch); zp 0
    s, z = P.choose_qparams(-2.54, 1.0, symmetric=True)
    assert s == F32(2.54 / 127.5) and z == 0
    # narrow range [-127, 127]: divisor 127 (ONNX Runtime); 2.54 / 127 = 0.02
    s, z = P.choose_qparams(-2.54, 1.0, symmetric=True, narrow_range=True)
    assert s == F32(2.54 / 127.0) and z == 0
    # the larger magnitude wins, on either side
    assert P.choose_qparams(-0.5, 3.0, symmetric=True)[0] == F32(3.0 / 127.5)
    # uint8 symmetric: zp is the middle, (0 + 255 + 1) // 2 = 128
    assert P.choose_qparams(-1.0, 1.0, "uint8", symmetric=True) == (F32(1 / 127.5), 128)
    # reduce_range uint8 [0, 127]: middle 64, divisor 63.5
    assert P.choose_qparams(-1.0, 1.0, "uint8", True, reduce_range=True) == (F32(1 / 63.5), 64)
    # reduce_range int8 [-64, 63]: middle (-64 + 63 + 1) // 2 = 0
    assert P.choose_qparams(-1.0, 1.0, "int8", True, reduce_range=True) == (F32(1 / 63.5), 0)
    # int16 narrow: divisor 32767
    assert P.choose_qparams(-1.0, 1.0, "int16", True, True)[0] == F32(1 / 32767.0)


def test_choose_qparams_degenerate_ranges():
    # all-zero tensor: scale 1 (never 0 or NaN), zero point that maps 0 exactly
    assert P.choose_qparams(0.0, 0.0) == (1.0, 0)
    assert P.choose_qparams(0.0, 0.0, "uint8") == (1.0, 0)
    # symmetric keeps the middle of the range even for a degenerate channel
    assert P.choose_qparams(0.0, 0.0, "uint8", symmetric=True) == (1.0, 128)
    assert P.choose_qparams(0.0, 0.0, "int8", symmetric=True) == (1.0, 0)
    # a range so small that the scale would be subnormal (below float32 tiny) is degenerate
    s, z = P.choose_qparams(-1e-40, 1e-40)
    assert s == 1.0 and z == 0
    # the smallest non-degenerate one stays
    tiny = float(np.finfo(np.float32).tiny)
    s, _ = P.choose_qparams(0.0, tiny * 255 * 2, "uint8")
    assert s == F32(tiny * 2)


def test_choose_qparams_per_channel():
    rmin = np.array([-0.5, 0.0, -3.0, 1.0])
    rmax = np.array([0.25, 0.0, 0.0, 2.0])
    s, z = P.choose_qparams(rmin, rmax, symmetric=True, narrow_range=True)
    assert s.shape == (4,) and z.shape == (4,)
    # channel 1 is all zero -> scale 1; channel 3 is widened to [0, 2]
    assert s.tolist() == [F32(0.5 / 127), 1.0, F32(3.0 / 127), F32(2.0 / 127)]
    assert z.tolist() == [0, 0, 0, 0]
    s, z = P.choose_qparams(rmin, rmax, "uint8")
    assert s.tolist() == [F32(0.75 / 255), 1.0, F32(3.0 / 255), F32(2.0 / 255)]
    # -0.5 / (0.75/255) = -170 -> zp 170; [-3, 0] -> zp 255; [0, 2] -> zp 0
    assert z.tolist() == [170, 0, 255, 0]


def test_choose_qparams_errors():
    with pytest.raises(ValueError, match="same shape"):
        P.choose_qparams(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="NaN or Inf"):
        P.choose_qparams(-np.inf, 1.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        P.choose_qparams(np.array([0.0, np.nan]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="unsupported quantized dtype"):
        P.choose_qparams(0.0, 1.0, "float16")


QDTYPES = st.sampled_from(["int8", "uint8", "int16", "uint16"])
REAL = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@SETTINGS
@given(
    a=REAL,
    b=REAL,
    dtype=QDTYPES,
    symmetric=st.booleans(),
    narrow=st.booleans(),
    reduce=st.booleans(),
)
def test_choose_qparams_properties(a, b, dtype, symmetric, narrow, reduce):
    rmin, rmax = min(a, b), max(a, b)
    qmin, qmax = P.qrange(dtype, narrow, reduce)
    s, z = P.choose_qparams(rmin, rmax, dtype, symmetric, narrow, reduce)
    assert s.dtype == np.float32 and z.dtype == np.int32
    assert np.isfinite(s) and s > 0
    assert qmin <= z <= qmax  # the zero point is a value of the range
    if symmetric:
        assert z == (qmin + qmax + 1) // 2  # the middle
    # 0.0 is exactly representable: quantize(0) dequantizes to 0
    assert P.dequantize(P.quantize(0.0, s, z, dtype), s, z) == 0.0
    # every x of [rmin, rmax] comes back within half a step (plus float32 rounding)
    xs = np.linspace(rmin, rmax, 33).astype(np.float32)
    err = np.abs(P.dequantize(P.quantize(xs, s, z, dtype), s, z) - xs.astype(np.float64))
    tol = float(s) / 2 + 2.0**-22 * (np.abs(xs.astype(np.float64)) + float(s))
    assert np.all(err <= tol), (xs[err > tol], err[err > tol], s, z)


def test_choose_qparams_symmetric_unsigned_is_centered():
    # Symmetric uint8 keeps zp = 128 even for an all-negative range ([-1, -0.5] is [-1, 0]
    # after widening): it spans [-128 s, 127 s] with s = 1 / 127.5, half of it unused.
    # -1 / s = -127.49999 (float32) -> -127 -> q = 1, within half a step of -1.
    s, z = P.choose_qparams(-1.0, -0.5, "uint8", symmetric=True)
    assert z == 128 and s == F32(1 / 127.5)
    q = P.quantize(-1.0, s, z, "uint8")
    assert q == 1 and abs(P.dequantize(q, s, z) + 1.0) <= s / 2


# ---------------------------------------------------------------- quantize / dequantize


def test_quantize_golden():
    # scale 0.5, zp 1: x / 0.5 = 0.5 -> 0 (tie to even), 1.5 -> 2, 2.5 -> 2, -0.5 -> -0,
    # -1.5 -> -2, -2.5 -> -2; then + 1
    x = np.array([0.25, 0.75, 1.25, -0.25, -0.75, -1.25], np.float32)
    assert P.quantize(x, 0.5, 1).tolist() == [1, 3, 3, 1, -1, -1]
    # saturation at both ends, and infinities
    assert P.quantize(np.array([63.5, 64.0, -64.5, -65.0, np.inf, -np.inf]), 0.5, 0).tolist() == [
        127,
        127,
        -128,
        -128,
        127,
        -128,
    ]
    # -0.0 quantizes like 0.0
    assert P.quantize(np.float32(-0.0), 0.5, 3) == 3
    # the ONNX QuantizeLinear example: uint8, scale 2, zp 128; 3 / 2 = 1.5 -> 2
    x = np.array([0, 2, 3, 1000, -254, -1000], np.float32)
    assert P.quantize(x, 2.0, 128, "uint8").tolist() == [128, 129, 130, 255, 1, 0]
    # int16 / uint16 ties: 5 / 2 = 2.5 -> 2, 7 / 2 = 3.5 -> 4
    assert P.quantize(np.array([5.0, 7.0, 1e6]), 2.0, 256, "int16").tolist() == [258, 260, 32767]
    assert P.quantize(np.array([5.0, -1e6]), 2.0, 32767, "uint16").tolist() == [32769, 0]
    # negative zero point and narrow values
    assert P.quantize(np.array([0.0, 1.0, -1.0]), 0.1, -100).tolist() == [-100, -90, -110]
    assert P.quantize(np.array([1.0]), 0.1, -100).dtype == np.int8


def test_quantize_divides_not_reciprocal():
    # x / s and x * (1 / s) differ for some x near ties (pytorch/ao#229): quantize divides.
    # -19.55 (float32 -19.549999237...) / 0.1 rounds to -195.49998 -> -195 while the
    # reciprocal product rounds to -195.5 -> -196.
    x, s = F32(-19.55), F32(0.1)
    assert np.rint(x / s) == -195 and np.rint(x * (F32(1) / s)) == -196
    assert P.quantize(x, s, 0, "int16") == -195


def test_quantize_per_axis():
    x = np.array([[0.1, -0.2, 0.35], [0.1, -0.2, 0.35]], np.float32)
    # axis 0: scales 0.1, 0.01; zps 0, 5
    q = P.quantize(x, np.array([0.1, 0.01]), np.array([0, 5]), axis=0)
    # row 0: 1, -2 and 0.35f / 0.1f, which float32 division rounds to exactly 3.5 (a tie,
    # to even: 4); row 1: 10 + 5, -20 + 5, 35 + 5
    assert F32(0.35) / F32(0.1) == F32(3.5)
    assert q.tolist() == [[1, -2, 4], [15, -15, 40]]
    # axis -1 and 1 are the same dimension
    a1 = P.quantize(x, np.array([0.1, 0.2, 0.05]), np.array([-1, 0, 1]), axis=1)
    a2 = P.quantize(x, np.array([0.1, 0.2, 0.05]), np.array([-1, 0, 1]), axis=-1)
    assert np.array_equal(a1, a2) and a1.tolist() == [[0, -1, 8], [0, -1, 8]]
    # a per-axis parameter without an axis is an error
    with pytest.raises(ValueError, match="needs an axis"):
        P.quantize(x, np.array([0.1, 0.2, 0.05]), 0)
    # a 1-element array acts as a scalar
    assert np.array_equal(P.quantize(x, np.array([0.1]), np.array([2])), P.quantize(x, 0.1, 2))


def test_quantize_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="unsupported quantized dtype 'float32'"):
        P.quantize(1.0, 1.0, 0, "float32")


def test_dequantize_golden():
    assert P.dequantize(np.array([-128, 0, 127], np.int8), 0.5, -128).tolist() == [0, 64, 127.5]
    # uint8 with zp 128 (ONNX DequantizeLinear example)
    q = np.array([0, 3, 128, 255], np.uint8)
    assert P.dequantize(q, 2.0, 128).tolist() == [-256, -250, 0, 254]
    # the difference is taken in integers, then converted once: int32 2**31 - 1 minus zp -1
    # is 2**31 (no wrap); 16777217 is not a float32 and rounds to 16777216 (ties to even)
    q = np.array([2**31 - 1, 16777217], np.int32)
    d = P.dequantize(q, 1.0, np.array(-1))
    assert d.tolist() == [2.0**31, 16777218.0]
    assert P.dequantize(np.array([16777217], np.int32), 1.0, 0).tolist() == [16777216.0]
    # one float32 multiply: 3 * 0.1f rounds once
    assert P.dequantize(np.array([3], np.int8), 0.1, 0)[0] == F32(3) * F32(0.1)
    # per-axis
    d = P.dequantize(np.array([[1, 2], [1, 2]], np.int8), np.array([0.5, 2.0]), [0, 1], axis=0)
    assert d.tolist() == [[0.5, 1.0], [0.0, 2.0]]
    assert d.dtype == np.float32


@SETTINGS
@given(
    dtype=QDTYPES,
    scale=st.floats(float(F32(1e-6)), 1e3, width=32),
    zfrac=st.floats(0, 1),
    t=st.lists(st.floats(0, 1), min_size=1, max_size=20),
)
def test_quantize_roundtrip_error_within_half_step(dtype, scale, zfrac, t):
    # For x inside the representable range [(qmin - zp) s, (qmax - zp) s]:
    # |dequantize(quantize(x)) - x| <= s / 2 (plus float32 rounding of x / s and of the
    # final multiply, bounded by 2**-22 (|x| + s)).
    qmin, qmax = P.qrange(dtype)
    zp = int(qmin + round(zfrac * (qmax - qmin)))
    s = F32(scale)
    lo, hi = (qmin - zp) * float(s), (qmax - zp) * float(s)
    x = np.array([lo + ti * (hi - lo) for ti in t], np.float32)
    x = np.clip(x, F32(lo), F32(hi))
    q = P.quantize(x, s, zp, dtype)
    assert q.dtype == np.dtype(dtype)
    err = np.abs(P.dequantize(q, s, zp).astype(np.float64) - x.astype(np.float64))
    tol = float(s) / 2 + 2.0**-22 * (np.abs(x.astype(np.float64)) + float(s))
    assert np.all(err <= tol)


@SETTINGS
@given(
    dtype=QDTYPES,
    scale=st.floats(float(F32(1e-3)), 10, width=32),
    x=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=20),
)
def test_quantize_is_clipped_rounded_division(dtype, scale, x):
    # against an exact reference: round_half_even(fl32(x / s)) + zp, clipped
    qmin, qmax = P.qrange(dtype)
    zp = (qmin + qmax) // 2
    x = np.array(x, np.float32)
    q = P.quantize(x, scale, zp, dtype)
    for xi, qi in zip(x, q, strict=True):
        v = round_fraction(fq(xi / F32(scale)), "half_even") + zp
        assert int(qi) == min(max(v, qmin), qmax)


# ---------------------------------------------------------------- rounding primitives


def test_round_half_every_rule():
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -0.4999999, 0.5000001, 1e17 + 2])
    assert P.round_half(x, "half_even").tolist() == [-2, -2, -0.0, 0, 2, 2, -0.0, 1, 1e17 + 2]
    assert P.round_half(x, "half_away").tolist() == [-3, -2, -1, 1, 2, 3, -0.0, 1, 1e17 + 2]
    assert P.round_half(x, "half_up").tolist() == [-2, -1, 0, 1, 2, 3, 0, 1, 1e17 + 2]
    with pytest.raises(ValueError, match="unknown tie rule"):
        P.round_half(x, "tflite")


def test_rounding_right_shift_golden():
    x = np.array([5, 6, 7, -5, -6, -7, 2, -2, 0])
    # / 4: 1.25 1.5 1.75 -1.25 -1.5 -1.75 0.5 -0.5 0
    assert P.rounding_right_shift(x, 2, "half_even").tolist() == [1, 2, 2, -1, -2, -2, 0, 0, 0]
    assert P.rounding_right_shift(x, 2, "half_away").tolist() == [1, 2, 2, -1, -2, -2, 1, -1, 0]
    assert P.rounding_right_shift(x, 2, "half_up").tolist() == [1, 2, 2, -1, -1, -2, 1, 0, 0]
    # shift 0 is the identity in every mode
    for mode in ("half_even", "half_away", "half_up"):
        assert P.rounding_right_shift(x, 0, mode).tolist() == x.tolist()
    # per-element shifts
    assert P.rounding_right_shift(np.array([3, 3, 3]), np.array([0, 1, 2])).tolist() == [3, 2, 1]
    # large values stay exact in int64 (no float conversion): (2**62 + 2**10 + 2**9) / 2**10
    # = 2**52 + 1.5 -> 2**52 + 2
    big = np.array([2**62 + 2**10 + 2**9])
    assert P.rounding_right_shift(big, 10, "half_even").tolist() == [2**52 + 2]
    with pytest.raises(ValueError, match="shift >= 0"):
        P.rounding_right_shift(x, -1)
    with pytest.raises(ValueError, match="unknown tie rule"):
        P.rounding_right_shift(x, 1, "tflite")


@SETTINGS
@given(
    x=st.integers(-(2**62), 2**62 - 1),
    shift=st.integers(0, 62),
    rule=st.sampled_from(["half_even", "half_away", "half_up"]),
)
def test_rounding_right_shift_exact(x, shift, rule):
    got = int(P.rounding_right_shift(np.array([x]), shift, rule)[0])
    assert got == round_fraction(Fraction(x, 2**shift), rule)


# --------------------------------------------------------------- quantize_multiplier


def test_quantize_multiplier_golden():
    # 0.75 = 0.75 * 2**0 -> m = 0.75 * 2**31; 0.1 = 0.8 * 2**-3 -> m = round(0.8 * 2**31)
    # 2.0 = 0.5 * 2**2; 1.0 = 0.5 * 2**1; 0.5 = 0.5 * 2**0
    m, s = P.quantize_multiplier(np.array([0.75, 0.1, 2.0, 1.0, 0.5]))
    assert m.tolist() == [1610612736, 1717986918, 2**30, 2**30, 2**30]
    assert s.tolist() == [0, -3, 2, 1, 0]
    assert m.dtype == np.int32 and s.dtype == np.int32
    # carry: 1 - 2**-40 has frac 1 - 2**-40, and frac * 2**31 rounds up to 2**31, which is
    # not an int32: the result becomes m = 2**30 with the exponent one higher (= 1.0)
    m, s = P.quantize_multiplier(1 - 2.0**-40)
    assert (int(m), int(s)) == (2**30, 1)
    # just below the carry: frac * 2**31 = 2**31 - 1 exactly stays
    m, s = P.quantize_multiplier((2**31 - 1) / 2**31)
    assert (int(m), int(s)) == (2**31 - 1, 0)
    # a tie in frac * 2**31 (2**30 + 0.5) rounds half to even (TFLite's std::round would
    # give 2**30 + 1; either is within half an LSB)
    m, s = P.quantize_multiplier(0.5 + 2.0**-32)
    assert (int(m), int(s)) == (2**30, 0)
    m, s = P.quantize_multiplier(0.5 + 3 * 2.0**-32)
    assert (int(m), int(s)) == (2**30 + 2, 0)
    # tiny multipliers: 2**-32 = 0.5 * 2**-31 is still represented (shift -31); below
    # that (exponent < -31) any |x| < 2**31 gives |x * real| < 1/2, so m = 0 and shift 0
    assert [int(v) for v in P.quantize_multiplier(2.0**-32)] == [2**30, -31]
    assert [int(v) for v in P.quantize_multiplier(2.0**-33)] == [0, 0]
    assert [int(v) for v in P.quantize_multiplier(1e-30)] == [0, 0]
    # zero
    assert [int(v) for v in P.quantize_multiplier(0.0)] == [0, 0]
    # large multipliers: 3e5 = 0.5722... * 2**19
    m, s = P.quantize_multiplier(3e5)
    assert int(s) == 19 and int(m) == round(3e5 / 2**19 * 2**31)


@pytest.mark.parametrize("bad", [-0.5, np.inf, np.nan])
def test_quantize_multiplier_rejects(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        P.quantize_multiplier(bad)


@SETTINGS
@given(real=st.floats(2.0**-31, 2.0**20))
def test_quantize_multiplier_accuracy(real):
    m, s = P.quantize_multiplier(real)
    m, s = int(m), int(s)
    assert 2**30 <= m < 2**31
    approx = Fraction(m) * Fraction(2) ** (s - 31)
    # m is within half an LSB of frac * 2**31
    assert abs(approx - Fraction(real)) <= Fraction(2) ** (s - 32)


# -------------------------------------------------------------- fixed_point_multiply


def test_fixed_point_multiply_golden():
    m, s = P.quantize_multiplier(0.5)  # m = 2**30, shift 0: TFLite right shift 0
    modes = ("tflite", "tflite_single", "half_even", "half_away", "half_up")
    fpm = P.fixed_point_multiply
    # 15 * 0.5 = 7.5 (tie): every mode rounds up to 8
    assert [int(fpm(15, m, s, r)) for r in modes] == [8, 8, 8, 8, 8]
    # -15 * 0.5 = -7.5: gemmlowp's doubling high multiply nudges negative products by
    # 1 - 2**30 and truncates, so its negative ties go toward zero (-7) like half_up
    assert [int(fpm(-15, m, s, r)) for r in modes] == [-7, -7, -8, -8, -7]
    # 13 * 0.5 = 6.5 separates half_even (6) from the others (7)
    assert [int(fpm(13, m, s, r)) for r in modes] == [7, 7, 6, 7, 7]
    # ratio 0.25 (m = 2**30, shift -1): TFLite's right shift is 1, and RoundingDivideByPOT
    # rounds ties away from zero: -6 * 0.25 = -1.5 -> -2 (not -1 as with ratio 0.5)
    m, s = P.quantize_multiplier(0.25)
    assert [int(fpm(-6, m, s, r)) for r in modes] == [-2, -1, -2, -2, -1]
    assert [int(fpm(-10, m, s, r)) for r in modes] == [-3, -2, -2, -3, -2]
    # m = 3 * 2**29 (0.75) with shift -1 is the ratio 0.375; 4 * 0.375 = 1.5 is a tie:
    # TFLite's high multiply is exactly 3, then 3 / 2 rounds away from zero -> 2
    assert [int(fpm(4, 3 * 2**29, -1, r)) for r in modes] == [2, 2, 2, 2, 2]
    assert [int(fpm(-4, 3 * 2**29, -1, r)) for r in modes] == [-2, -1, -2, -2, -1]
    # TFLite's double rounding: x = 11, m = 2**31 - 1, shift -1:
    # exact 11 * (2**31 - 1) / 2**32 = 5.4999999974 -> 5 in the exact modes, but the
    # high multiply first rounds 10.999999995 to 11, then 11 / 2 = 5.5 -> 6
    assert [int(fpm(11, 2**31 - 1, -1, r)) for r in modes] == [6, 5, 5, 5, 5]
    # left shifts (ratio >= 1): 100 * 3.0 = 300 exactly in every mode
    m, s = P.quantize_multiplier(3.0)
    assert [int(fpm(100, m, s, r)) for r in modes] == [300] * 5
    # TFLite saturates the shifted input to int32: (2**30) << 2 -> 2**31 - 1
    assert int(fpm(2**30, 2**30, 2, "tflite")) == gemmlowp_srdhm(2**31 - 1, 2**30)
    # the only overflowing case of the doubling high multiply: -2**31 * -2**31
    assert int(fpm(-(2**31), -(2**31), 0, "tflite")) == 2**31 - 1
    # a zero multiplier (tiny real) gives 0
    assert [int(fpm(2**31 - 1, 0, 0, r)) for r in modes] == [0] * 5
    # per-element multipliers and shifts broadcast
    got = fpm(np.array([10, 10, 10]), np.array([2**30, 2**30, 3 * 2**29]), np.array([0, -1, 0]))
    assert got.tolist() == [5, 3, 8]  # 5, 2.5 -> 3 (tflite: positive tie up), 7.5 -> 8


MULT = st.one_of(st.integers(2**30, 2**31 - 1), st.just(0))


@SETTINGS
@given(
    x=st.integers(-(2**31), 2**31 - 1),
    m=MULT,
    shift=st.integers(-31, 31),
)
def test_fixed_point_multiply_matches_exact_references(x, m, shift):
    fpm = P.fixed_point_multiply
    for rule in ("half_even", "half_away", "half_up"):
        assert int(fpm(x, m, shift, rule)) == exact_multiply(x, m, shift, rule)
    # tflite_single: one rounding, ties toward +inf = half_up
    assert int(fpm(x, m, shift, "tflite_single")) == tflite_single_multiply(x, m, shift)
    assert tflite_single_multiply(x, m, shift) == exact_multiply(x, m, shift, "half_up")
    # tflite: gemmlowp transcription
    assert int(fpm(x, m, shift, "tflite")) == tflite_multiply(x, m, shift)


@SETTINGS
@given(
    x=st.integers(-(2**31), 2**31 - 1),
    m=st.integers(2**30, 2**31 - 1),
    shift=st.integers(-31, 0),
)
def test_tflite_double_rounding_window(x, m, shift):
    # TFLite rounds twice (to 31 bits, then by 2**right): it differs from one exact
    # rounding by at most 1, and only within 2**-(right + 1) of a tie.
    v = Fraction(x * m) * Fraction(2) ** (shift - 31)
    got = int(P.fixed_point_multiply(x, m, shift, "tflite"))
    exact = round_fraction(v, "half_away")
    assert abs(got - exact) <= 1
    if got != exact:
        assert dist_to_tie(v) <= Fraction(1, 2 ** (-shift + 1))


@SETTINGS
@given(
    x=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=8),
    m=MULT,
    shift=st.integers(-31, 31),
    rule=st.sampled_from(["half_even", "half_away", "half_up", "tflite", "tflite_single"]),
)
def test_fixed_point_multiply_vectorized(x, m, shift, rule):
    # arrays give the same answers as scalars
    got = P.fixed_point_multiply(np.array(x), m, shift, rule).tolist()
    assert got == [int(P.fixed_point_multiply(xi, m, shift, rule)) for xi in x]


# ---------------------------------------------------------------------- requantize


def test_requantize_golden():
    # 1000 at scale 0.001 is 1.0 -> 50 at scale 0.02, + zp 3 = 53 in every mode
    for mode in P.ROUNDING_MODES:
        assert P.requantize(np.array([1000], np.int32), 0.001, 0, 0.02, 3, rounding=mode) == 53
    # ties with ratio 0.5: 5 -> 2.5, -5 -> -2.5
    q = np.array([5, -5], np.int32)
    got = {r: P.requantize(q, 0.5, 0, 1.0, 0, rounding=r).tolist() for r in P.ROUNDING_MODES}
    assert got == {
        "float": [2, -2],  # float32 then round half to even
        "half_even": [2, -2],
        "half_away": [3, -3],
        "half_up": [3, -2],
        "tflite": [3, -2],  # right shift 0: the doubling high multiply's tie rule
        "tflite_single": [3, -2],
    }
    # saturation of the output, with zero points
    q = np.array([2**31 - 1, -(2**31), 300, -300], np.int32)
    for mode in P.ROUNDING_MODES:
        assert P.requantize(q, 1.0, 0, 1.0, 5, "int8", mode).tolist() == [127, -128, 127, -128]
        assert P.requantize(q, 1.0, 0, 2.0, 100, "uint8", mode).tolist() == [255, 0, 250, 0]
    # int32 output saturates at 2**31 - 1 (float32 cannot hold it: the float mode clips in
    # float64 before the cast)
    big = np.array([2**31 - 1, -(2**31)], np.int32)
    for mode in ("float", "half_even", "half_away", "half_up", "tflite_single"):
        got = P.requantize(big, 3.0, 0, 1.0, 0, "int32", mode)
        assert got.tolist() == [2**31 - 1, -(2**31)], mode
    # ... except tflite, whose left shift (ratio 3 = 0.75 * 2**2) saturates the *input*
    # to int32 first (TFLite leaves that overflow undefined): sat(x * 4) * 0.75 is
    # +-0.75 * 2**31, not the int32 limit. Outputs of 8 or 16 bits are unaffected (any
    # value >= 2**30 saturates there anyway).
    got = P.requantize(big, 3.0, 0, 1.0, 0, "int32", "tflite")
    assert got.tolist() == [1610612735, -1610612736]
    assert P.requantize(big, 3.0, 0, 1.0, 0, "int16", "tflite").tolist() == [32767, -32768]
    # an input zero point (int8 -> uint8): (q - (-5)) * 0.5 / 0.25 + 3
    q = np.array([-128, -5, 0, 127], np.int8)
    for mode in P.ROUNDING_MODES:
        assert P.requantize(q, 0.5, -5, 0.25, 3, "uint8", mode).tolist() == [0, 3, 13, 255]
    # int16 output
    assert P.requantize(np.array([12345], np.int32), 0.01, 0, 0.1, -7, "int16").tolist() == [
        1227
    ]  # 1234.5 -> 1234 (tie to even) - 7
    # tiny ratio: everything maps to the output zero point
    for mode in P.ROUNDING_MODES:
        assert P.requantize(np.array([2**31 - 1]), 1e-12, 0, 1.0, 9, rounding=mode) == 9


def test_requantize_per_axis():
    acc = np.array([[10, -10], [10, -10], [7, -7]], np.int32)  # channels along axis 0
    s_in = np.array([0.25, 0.5, 3.0], np.float32)
    # ratios 0.25, 0.5, 3.0: 2.5 -2.5 | 5 -5 | 21 -21
    for mode, row0 in [("float", [2, -2]), ("half_away", [3, -3]), ("tflite", [3, -3])]:
        got = P.requantize(acc, s_in, 0, 1.0, 0, "int8", mode, axis=0)
        assert got.tolist() == [row0, [5, -5], [21, -21]], mode
    with pytest.raises(ValueError, match="unknown rounding mode 'nearest'"):
        P.requantize(acc, 1.0, 0, 1.0, 0, rounding="nearest")


SCALE = st.floats(float(F32(1e-6)), 1.0, width=32)


@settings(max_examples=400, deadline=None)
@given(
    q=st.lists(
        st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-5000, 5000)),
        min_size=1,
        max_size=16,
    ),
    s_in=SCALE,
    s_out=SCALE,
    tie_k=st.one_of(st.none(), st.integers(1, 8)),
    zin=st.integers(-128, 127),
    zout=st.integers(-128, 127),
    out_dtype=st.sampled_from(["int8", "int16"]),
)
def test_requantize_modes_agree_except_near_ties(q, s_in, s_out, tie_k, zin, zout, out_dtype):
    # Every mode is within 1 of the exact rational result rounded half to even, and
    # differs from it only where that exact value is within a small epsilon of a tie:
    # float32 rounding (float mode) and the 31-bit multiplier (integer modes) are relative
    # errors below 2**-21 of |v|; TFLite's double rounding adds a window of
    # 2**-(right + 1), right = -shift, below each tie.
    if tie_k is not None:
        # ratio exactly 2**-tie_k: exact ties at every odd multiple of 2**(tie_k - 1)
        s_out = float(F32(s_in) * F32(2.0**tie_k))
    qmin, qmax = P.qrange(out_dtype)
    qa = np.array(q, np.int64)
    # keep the int32 input meaningful: the difference with zin stays an int32
    qa = np.clip(qa, -(2**31) + 128, 2**31 - 129).astype(np.int32)
    ratio = fq(s_in) / fq(s_out)
    _, shift = P.quantize_multiplier(float(F32(s_in)) / float(F32(s_out)))
    results = {r: P.requantize(qa, s_in, zin, s_out, zout, out_dtype, r) for r in P.ROUNDING_MODES}
    for i, qi in enumerate(qa.tolist()):
        v = (qi - zin) * ratio
        exact = min(max(round_fraction(v, "half_even") + zout, qmin), qmax)
        eps = abs(v) * Fraction(1, 2**21) + Fraction(1, 2**30)
        for r, res in results.items():
            got = int(res[i])
            assert abs(got - exact) <= 1, (r, qi, float(v))
            if got != exact:
                window = eps + (Fraction(1, 2 ** (-int(shift) + 1)) if r == "tflite" else 0)
                assert dist_to_tie(v) <= window, (r, qi, float(v))
    # pairwise: at most 1 apart
    vals = np.stack([res.astype(np.int64) for res in results.values()])
    assert np.all(vals.max(0) - vals.min(0) <= 1)


@SETTINGS
@given(
    q=st.lists(st.integers(-128, 127), min_size=1, max_size=16),
    s_in=SCALE,
    s_out=SCALE,
    zin=st.integers(-128, 127),
    zout=st.integers(-128, 127),
)
def test_requantize_float_is_quantize_of_dequantize(q, s_in, s_out, zin, zout):
    qa = np.array(q, np.int8)
    ref = P.quantize(P.dequantize(qa, s_in, zin), s_out, zout)
    assert np.array_equal(P.requantize(qa, s_in, zin, s_out, zout), ref)


# --------------------------------------------------------------------- elementwise


def test_elementwise_multipliers_golden():
    # add 0.5 / 1 and 0.25 / 1: the larger (0.5) gets 31 significant bits: 0.5 * 2**31
    assert P.elementwise_multipliers("add", 0.5, 0.25, 1.0) == (2**30, 2**29, 31)
    assert P.elementwise_multipliers("subtract", 0.25, 0.5, 1.0) == (2**29, 2**30, 31)
    # multiply: one multiplier for 0.5 * 0.25 / 1 = 0.125 -> 2**30 at shift 33
    assert P.elementwise_multipliers("multiply", 0.5, 0.25, 1.0) == (2**30, 0, 33)
    # carry: ratio 1 - 2**-40 rounds to 2**31 at shift 31; the shift drops to 30
    r = 1 - 2.0**-40
    assert P.elementwise_multipliers("add", r, 0.5, 1.0) == (2**30, 2**29, 30)
    # the scales are float32 first: 0.1 is 0.100000001490116...
    ma, mb, sh = P.elementwise_multipliers("add", 0.1, 0.1, 1.0)
    assert sh == 34 and ma == mb == round(float(F32(0.1)) * 2**34)
    # ratios out of range: shift would be negative (>= 2**31) or above 62
    with pytest.raises(ValueError, match="out of the range"):
        P.elementwise_multipliers("add", 2.0**40, 1.0, 1.0)
    with pytest.raises(ValueError, match="out of the range"):
        P.elementwise_multipliers("multiply", 2.0**-30, 2.0**-30, 1.0)
    with pytest.raises(ValueError, match="unknown elementwise op 'divide'"):
        P.elementwise_multipliers("divide", 1.0, 1.0, 1.0)


def test_elementwise_golden():
    modes = ("float", "half_even", "half_away", "half_up", "tflite", "tflite_single")

    def all_modes(kind, *args, **kw):
        # tflite: TFLite's three-rounding kernel (autoq.qnn.tflite_arith), the same results here
        ref = {"tflite": TA.elementwise}
        return [int(ref.get(r, P.elementwise)(kind, *args, rounding=r, **kw)) for r in modes]

    # 0.5 * (3 - 1) + 0.25 * (2 - 0) = 1.5 at scale 1.0: a tie
    assert all_modes("add", 3, 0.5, 1, 2, 0.25, 0, 1.0, 0) == [2, 2, 2, 2, 2, 2]
    # 0.5 * 1 + 0.25 * 0 = 0.5: half_even 0, others 1
    assert all_modes("add", 1, 0.5, 0, 0, 0.25, 0, 1.0, 0) == [0, 0, 1, 1, 1, 1]
    # 0.5 * 1 - 0.5 * 4 = -1.5: even -2, away -2, up -1; tflite ties away, single up
    assert all_modes("subtract", 1, 0.5, 0, 4, 0.5, 0, 1.0, 0) == [-2, -2, -2, -1, -2, -1]
    # -0.5: even 0 (-0), away -1, up 0
    assert all_modes("subtract", 0, 0.5, 0, 1, 0.5, 0, 1.0, 0) == [0, 0, -1, 0, -1, 0]
    # multiply: (10 - 0) * 0.5 * (-3 - 1) * 0.25 = -5 at scale 0.5 -> -10, + zp 7 = -3
    assert all_modes("multiply", 10, 0.5, 0, -3, 0.25, 1, 0.5, 7) == [-3] * 6
    # multiply tie: 3 * 0.5 * 1 * 1 = 1.5 -> 2 (even), 2, 2, 2, 2
    assert all_modes("multiply", 3, 0.5, 0, 1, 1.0, 0, 1.0, 0) == [2, 2, 2, 2, 2, 2]
    # saturation and uint8 output
    assert all_modes("add", 127, 1.0, 0, 127, 1.0, 0, 1.0, 0) == [127] * 6
    kw = {"dtype": "uint8"}
    assert all_modes("subtract", 0, 1.0, 0, 127, 1.0, 0, 1.0, 10, **kw) == [0] * 6
    # arrays with broadcasting
    got = P.elementwise(
        "add",
        np.array([[1, 2], [3, 4]]),
        1.0,
        0,
        np.array([10, 20]),
        1.0,
        0,
        1.0,
        0,
        rounding="half_even",
    )
    assert got.tolist() == [[11, 22], [13, 24]]
    with pytest.raises(ValueError, match="unknown rounding mode"):
        P.elementwise("add", 1, 1.0, 0, 1, 1.0, 0, 1.0, 0, rounding="up")


EW_SCALE = st.floats(float(F32(1e-3)), 1.0, width=32)


@SETTINGS
@given(
    kind=st.sampled_from(["add", "subtract", "multiply"]),
    a=st.lists(st.integers(0, 255), min_size=4, max_size=4),
    b=st.lists(st.integers(-128, 127), min_size=4, max_size=4),
    sa=EW_SCALE,
    sb=EW_SCALE,
    so=EW_SCALE,
    za=st.integers(0, 255),
    zb=st.integers(-128, 127),
    zo=st.integers(-128, 127),
    rounding=st.sampled_from(["half_even", "half_away", "half_up", "tflite_single"]),
)
def test_elementwise_integer_modes_exact(kind, a, b, sa, sb, so, za, zb, zo, rounding):
    try:
        ma, mb, shift = P.elementwise_multipliers(kind, sa, sb, so)
    except ValueError:
        assume(False)
    a, b = np.array(a, np.uint8), np.array(b, np.int8)
    got = P.elementwise(kind, a, sa, za, b, sb, zb, so, zo, "int16", rounding)
    rule = {"tflite": "half_away", "tflite_single": "half_up"}.get(rounding, rounding)
    for i in range(4):
        da, db = int(a[i]) - za, int(b[i]) - zb
        # exact reference with the integer multipliers
        if kind == "multiply":
            acc = da * db * ma
        else:
            acc = da * ma + (1 if kind == "add" else -1) * db * mb
        ref = round_fraction(Fraction(acc, 2**shift), rule) + zo
        assert int(got[i]) == min(max(ref, -32768), 32767)
        # and within 1 of the real result, differing only near a tie: each integer
        # multiplier is within 1/2 of its real value * 2**shift (plus float64 rounding of
        # the ratio), so the error is at most (|da| + |db|) / 2**(shift + 1) (|da * db| for
        # multiply). The shift is common to both operands, so the multiplier of the
        # smaller ratio has fewer significant bits (hypothesis found sa/so = 0.0033 next
        # to sb/so = 1.67: about 2**-22 relative error, still far below one step).
        if kind == "multiply":
            real = fq(F32(sa)) * da * fq(F32(sb)) * db / fq(F32(so))
            err = Fraction(abs(da * db), 2 ** (shift + 1))
        else:
            sign = 1 if kind == "add" else -1
            real = (fq(F32(sa)) * da + sign * fq(F32(sb)) * db) / fq(F32(so))
            err = Fraction(abs(da) + abs(db), 2 ** (shift + 1))
        ideal = round_fraction(real, rule) + zo
        if ideal != ref:
            assert abs(ideal - ref) == 1
            assert dist_to_tie(real) <= err + abs(real) * Fraction(1, 2**50)


@SETTINGS
@given(
    kind=st.sampled_from(["add", "subtract", "multiply"]),
    a=st.lists(st.integers(-128, 127), min_size=4, max_size=4),
    b=st.lists(st.integers(-128, 127), min_size=4, max_size=4),
    sa=EW_SCALE,
    sb=EW_SCALE,
    so=EW_SCALE,
)
def test_elementwise_float_mode_near_exact(kind, a, b, sa, sb, so):
    # float mode = quantize(dequantize(a) op dequantize(b)) in float32: within 1 of the
    # exact result, and different only close to a tie. Each dequantized operand carries a
    # float32 rounding (2**-24 relative), and so do the op and the division: the bound is
    # relative to the operands (|ra| + |rb|), not to the result (an add can cancel).
    a, b = np.array(a, np.int8), np.array(b, np.int8)
    got = P.elementwise(kind, a, sa, 0, b, sb, 0, so, 0, "int16", "float")
    for i in range(4):
        ra, rb = fq(F32(sa)) * int(a[i]), fq(F32(sb)) * int(b[i])
        real = {"add": ra + rb, "subtract": ra - rb, "multiply": ra * rb}[kind] / fq(F32(so))
        ideal = min(max(round_fraction(real, "half_even"), -32768), 32767)
        if int(got[i]) != ideal:
            assert abs(int(got[i]) - ideal) == 1
            mag = abs(ra * rb) if kind == "multiply" else abs(ra) + abs(rb)
            bound = (mag / fq(F32(so)) + abs(real)) * Fraction(1, 2**21)
            assert dist_to_tie(real) <= bound


# -------------------------------------------------------------------- quantize_bias


def test_quantize_bias_golden():
    # scale 0.5 * 0.01 = 0.005 (float32 product); 0.5 / 0.005 = 100; 1e9 saturates
    r = P.quantize_bias(np.array([0.5, -0.25, 1e9]), 0.5, np.array([0.01, 0.01, 0.01]))
    assert r.values.tolist() == [100, -50, 2**31 - 1] and r.saturated == 1
    assert r.values.dtype == np.int32
    assert r.scale.dtype == np.float32 and r.scale.tolist() == [F32(0.5) * F32(0.01)] * 3
    # the scale product is computed in float32, not float64
    r = P.quantize_bias(np.array([1.0]), 0.1, 0.2)
    assert r.scale == F32(0.1) * F32(0.2) and r.scale != np.float64(0.1) * 0.2
    # per-channel scales, negative saturation counted too, ties to even (0.5 / 1 -> 0,
    # 1.5 -> 2, -2.5 -> -2)
    r = P.quantize_bias(np.array([0.5, 1.5, -2.5, -1e12]), 1.0, np.array([1.0, 1.0, 1.0, 1e-3]))
    assert r.values.tolist() == [0, 2, -2, -(2**31)] and r.saturated == 1
    # the int32 boundary: float32(2**31 - 1) is 2**31, which does not fit -> saturated
    # and counted; -2**31 is exactly representable and fits
    r = P.quantize_bias(np.array([2**31 - 1, -(2**31)], np.float64), 1.0, 1.0)
    assert r.values.tolist() == [2**31 - 1, -(2**31)] and r.saturated == 1
    # nothing saturates in an ordinary layer
    assert P.quantize_bias(np.linspace(-1, 1, 10), 0.02, 0.003).saturated == 0


# ------------------------------------------------------------- simulate_accumulator


def test_simulate_accumulator_golden():
    x = np.array([40000, -40000, 100, 32767, 32768, -32768, -32769])
    assert P.simulate_accumulator(x, 16, "saturate").tolist() == [
        32767,
        -32768,
        100,
        32767,
        32767,
        -32768,
        -32768,
    ]
    # two's complement: 40000 - 65536 = -25536; 32768 -> -32768; -32769 -> 32767
    assert P.simulate_accumulator(x, 16, "wrap").tolist() == [
        -25536,
        25536,
        100,
        32767,
        -32768,
        -32768,
        32767,
    ]
    # 32 bits: 2**31 wraps to -2**31
    assert P.simulate_accumulator(np.array([2**31, 2**32 + 5]), 32, "wrap").tolist() == [
        -(2**31),
        5,
    ]
    # 2 bits: range [-2, 1]
    assert P.simulate_accumulator(np.arange(-3, 4), 2, "wrap").tolist() == [1, -2, -1, 0, 1, -2, -1]
    with pytest.raises(ValueError, match=r"bits must be in \[2, 32\]"):
        P.simulate_accumulator(x, 1)
    with pytest.raises(ValueError, match=r"bits must be in \[2, 32\]"):
        P.simulate_accumulator(x, 33)
    with pytest.raises(ValueError, match="unknown overflow mode 'clamp'"):
        P.simulate_accumulator(x, 16, "clamp")


@SETTINGS
@given(x=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=10), bits=st.integers(2, 32))
def test_simulate_accumulator_properties(x, bits):
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w = P.simulate_accumulator(np.array(x), bits, "wrap").tolist()
    s = P.simulate_accumulator(np.array(x), bits, "saturate").tolist()
    for xi, wi, si in zip(x, w, s, strict=True):
        assert lo <= wi <= hi and (wi - xi) % 2**bits == 0  # congruent mod 2**bits
        assert si == min(max(xi, lo), hi)


# ----------------------------------------------------- division by a constant scale via FMA


def _f32_round(v: Fraction) -> np.float32:
    """The float32 nearest the exact rational ``v`` (ties to even), normal range only."""
    lo = F32(float(v))  # float64 first, then adjusted: float() is RN of the Fraction
    candidates = {lo, np.nextafter(lo, F32(np.inf)), np.nextafter(lo, F32(-np.inf))}
    return min(
        candidates,
        key=lambda c: (abs(Fraction(float(c)) - v), int(np.asarray(c).view(np.int32)) & 1),
    )


finite_f32 = st.floats(-(2.0**100), 2.0**100, width=32)


@SETTINGS
@given(finite_f32, finite_f32, finite_f32)
def test_fma_float32_rounds_once(a, b, c):
    exact = Fraction(float(F32(a))) * Fraction(float(F32(b))) + Fraction(float(F32(c)))
    assume(exact == 0 or 2.0**-120 < abs(exact) < 2.0**120)
    got = P.fma_float32(F32(a), F32(b), F32(c))
    assert got == _f32_round(exact)


def test_fma_float32_golden_ties():
    a = F32(1 + 2**-12)  # a * a = 1 + 2**-11 + 2**-24, a midpoint of two float32
    assert P.fma_float32(a, a, F32(0)) == F32(1 + 2**-11)  # tie to even
    assert P.fma_float32(a, a, F32(2**-40)) == F32(1 + 2**-11 + 2**-23)  # just above: up
    assert P.fma_float32(a, a, F32(-(2**-40))) == F32(1 + 2**-11)  # just below: down
    b = F32(1 + 3 * 2**-12)  # a * b = 1 + 2**-10 + 3 * 2**-24: this tie rounds up, to even
    assert P.fma_float32(a, b, F32(0)) == F32(1 + 2**-10 + 2**-22)
    # separately rounded, (a * a) - 1 loses the 2**-24 the FMA keeps
    assert F32(a * a) - F32(1) != P.fma_float32(a, a, F32(-1))


# scales with a mantissa of all ones (r s = 1 + 2**-24: the worst reciprocal), exact
# reciprocals (1, powers of two), typical activation / accumulator scales and random ones
EDGE_SCALES = [1.99999988, 1.0, 0.5, 2.0**-7, 8.0, 0.1, 0.0123, 0.02, 3.0, 1.00000012, 0.0377]


@pytest.mark.parametrize("s", EDGE_SCALES + list(np.random.default_rng(5).uniform(1e-3, 1, 6)))
def test_divide_by_reciprocal_is_the_division(s):
    s = F32(s)
    s_in = F32(3.1e-5)
    steps = P.reciprocal_division_steps(s, s_in)
    r = F32(1) / s
    rng = np.random.default_rng(int(s.view(np.int32)))
    n = np.concatenate(
        [
            rng.integers(-(2**31), 2**31, 200_000),
            np.arange(-20_000, 20_000),  # small accumulators, around 0
            2**31 - 1 - np.arange(1000),
            -(2**31) + np.arange(1000),
        ]
    )
    x = (n.astype(F32) * s_in).astype(F32)
    np.testing.assert_array_equal(P.divide_by_reciprocal(x, s, r, steps), x / s)
    # every mantissa of one binade of x (the quotient's rounding repeats in every binade)
    x = (np.arange(2**23, 2**24, 7, dtype=np.int64).astype(F32) * F32(2**-23)).astype(F32)
    np.testing.assert_array_equal(P.divide_by_reciprocal(x, s, r, steps), x / s)
    assert steps == (1 if abs(Fraction(float(r)) * Fraction(float(s)) - 1) <= 2**-25 else 2)


def test_divide_by_reciprocal_needs_the_corrections():
    # the product alone is off in the last bit for many x (pytorch/ao#229); one correction
    # is not enough for a scale of mantissa all ones, two are
    s = F32(1.99999988)
    r = F32(1) / s
    x = (np.arange(2**23, 2**24, dtype=np.int64).astype(F32) * F32(2**-23)).astype(F32)
    assert np.count_nonzero(P.divide_by_reciprocal(x, s, r, 0) != x / s) > 1000
    assert P.reciprocal_division_steps(s, F32(1e-4)) == 2
    np.testing.assert_array_equal(P.divide_by_reciprocal(x, s, r, 2), x / s)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_code_division_steps_exact_on_every_code(dtype):
    """The count for 8-bit codes gives the exactly rounded quotient (Fraction) of every
    code; one correction where the general bound asks two (r s = 1 + 2**-24 and random
    accumulator-grid scales), and per channel the largest count."""
    rng = np.random.default_rng(9)
    lo, hi = P.qrange(dtype)
    divisors = [1.99999988, 1.99999988 * 2.0**-17, *rng.uniform(1e-6, 1e-4, 12), 0.5]
    ones = 0
    for d in np.array(divisors, F32):
        for s_in, z in ((F32(0.0064), lo), (F32(3.1e-2), 5)):
            steps = P.code_division_steps(d, s_in, z, dtype)
            general = P.reciprocal_division_steps(d, s_in)
            assert 1 <= steps <= general
            ones += steps < general
            x = P.dequantize(np.arange(lo, hi + 1), s_in, z)
            got = P.divide_by_reciprocal(x, d, F32(1) / d, steps)
            want = [_f32_round(Fraction(float(v)) / Fraction(float(d))) for v in x]
            np.testing.assert_array_equal(got, np.array(want, F32))
    assert ones > 0
    channels = np.array(divisors, F32)
    per_channel = P.code_division_steps(channels, F32(0.0064), lo, dtype)
    assert per_channel == max(P.code_division_steps(d, F32(0.0064), lo, dtype) for d in channels)


def test_reciprocal_division_steps_range():
    assert P.reciprocal_division_steps(F32(0.5), F32(1e-4)) == 1
    assert P.reciprocal_division_steps(np.array([0.5, 1.99999988], F32), F32(1e-4)) == 2
    assert P.reciprocal_division_steps(F32(0.02), F32(2.0**-70)) == 0  # x may underflow
    assert P.reciprocal_division_steps(F32(2.0**-70), F32(1e-3)) == 0
    assert P.reciprocal_division_steps(F32(2.0**-50), F32(2.0**20)) == 0  # x / s overflows


@SETTINGS
@given(
    st.integers(-(2**33) + 1, 2**33 - 1),
    st.floats(2.0**-60, 2.0**60, width=32),
    st.floats(2.0**-60, 2.0**60, width=32),
)
def test_divide_by_reciprocal_property(n, s_in, s):
    s, s_in = F32(s), F32(s_in)
    steps = P.reciprocal_division_steps(s, s_in)
    assume(steps > 0)
    x = F32(F32(n) * s_in)
    got = P.divide_by_reciprocal(x, s, F32(1) / s, steps)
    assert got == _f32_round(Fraction(float(x)) / Fraction(float(s))) or x == 0
