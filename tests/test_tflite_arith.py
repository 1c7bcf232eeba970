"""Golden vectors for autoq.tflite_arith (TFLite's integer kernels under rounding="tflite").

References are independent of the code under test: Python-int transcriptions of gemmlowp's
SaturatingRoundingDoublingHighMul / RoundingDivideByPOT (tests/test_primitives.py), C's
truncating integer division written out by hand, and exact ``Fraction`` arithmetic.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from test_primitives import tflite_multiply, tflite_single_multiply

from autoq import primitives as P
from autoq.qnn import tflite_arith as TA


def _c_div(a: int, b: int) -> int:
    """C/C++ integer division: truncates toward zero."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _tflite_average(total: int, count: int) -> int:
    """TFLite AveragePool: ``acc > 0 ? (acc + n/2) / n : (acc - n/2) / n`` in C."""
    half = count // 2
    return _c_div(total + half, count) if total > 0 else _c_div(total - half, count)


def test_divide_round_away_golden():
    # ties (even counts) go away from zero: 6/4 = 1.5 -> 2, -6/4 -> -2; 2/4 = 0.5 -> 1,
    # -2/4 -> -1 (half-even would give 0 and 0); non-ties round to nearest: 5/4 -> 1, -7/4 -> -2
    got = TA.divide_round_away(np.array([6, -6, 2, -2, 5, -7, 0]), 4)
    assert got.tolist() == [2, -2, 1, -1, 1, -2, 0]
    # odd count: no ties; -4/3 = -1.33 -> -1, -5/3 = -1.67 -> -2
    assert TA.divide_round_away(np.array([-4, -5, 4, 5]), 3).tolist() == [-1, -2, 1, 2]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 6, 9, 12, 25, 49, 64, 100])
def test_average_multiplier_is_tflites_division_for_every_window_sum(count):
    """A half_away fixed-point multiply by average_multiplier(count) equals TFLite's integer
    division for every window sum of int8 or uint8 values (exhaustive)."""
    totals = np.arange(-128 * count, 255 * count + 1, dtype=np.int64)
    m, shift = TA.average_multiplier(count)
    got = P.fixed_point_multiply(totals, m, shift, "half_away")
    ref = np.array([_tflite_average(int(t), count) for t in totals[:: max(1, count // 4)]])
    np.testing.assert_array_equal(got[:: max(1, count // 4)], ref)
    np.testing.assert_array_equal(got, TA.divide_round_away(totals, count))


def test_mean_multiplier_folds_one_over_n_like_tflite():
    """(m0 << k) // N, shift e - k; then MultiplyByQuantizedMultiplier(sum(q - zp))."""
    s_x, s_y, n = np.float32(0.0160526), np.float32(0.0117715), 64
    m0, e = (int(v) for v in P.quantize_multiplier(np.float64(s_x) / np.float64(s_y)))
    k = min(n.bit_length() - 1, 32, 31 + e)
    assert TA.mean_multiplier(s_x, s_y, n) == ((m0 << k) // n, e - k)
    # 1/N is folded by a truncating division: N = 3 loses the remainder (not a rounding)
    m, shift = TA.mean_multiplier(1.0, 1.0, 3)
    assert (m, shift) == ((2**30 << 1) // 3, 1 - 1)
    # applied to a sum, it is TFLite's double rounding of that multiplier
    sums = np.array([-300, -7, 0, 7, 299, 1000])
    got = P.fixed_point_multiply(sums, m, shift, "tflite")
    assert got.tolist() == [tflite_multiply(int(v), m, shift) for v in sums]


def _add_reference(kind, a, sa, za, b, sb, zb, so, zo, single: bool) -> int:
    """TFLite's ADD/SUB (add.cc Prepare + AddFunc) on Python ints, multipliers from exact
    fractions of the float32 scales (frexp, round half away)."""
    mul = tflite_single_multiply if single else tflite_multiply

    def quantize(real: Fraction) -> tuple[int, int]:
        frac, exp = np.frexp(float(real))
        frac, exp = float(frac), int(exp)
        q = int(Fraction(frac) * 2**31 + Fraction(1, 2))  # std::round (positive)
        return (q // 2, exp + 1) if q == 2**31 else (q, exp)

    fa, fb, fo = (Fraction(float(np.float32(v))) for v in (sa, sb, so))
    twice = 2 * max(fa, fb)
    (m1, s1), (m2, s2) = quantize(fa / twice), quantize(fb / twice)
    mo, so_ = quantize(twice / (2**20 * fo))
    x = mul((a - za) << 20, m1, s1)
    y = mul((b - zb) << 20, m2, s2)
    raw = x + y if kind == "add" else x - y
    return max(-128, min(127, mul(raw, mo, so_) + zo))


@pytest.mark.parametrize("rounding", ["tflite", "tflite_single"])
@pytest.mark.parametrize("kind", ["add", "subtract"])
def test_elementwise_add_is_tflites_three_roundings(kind, rounding):
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, 400).astype(np.int8)
    b = rng.integers(-128, 128, 400).astype(np.int8)
    # the tiny CNN's residual add (tests/data/tiny_cnn_int8.tflite) and power-of-two scales
    # (many exact ties at every rounding)
    for sa, za, sb, zb, so, zo in [
        (0.015091577, -128, 0.030938411, -27, 0.030442467, -30),
        (0.5, 1, 0.25, 0, 1.0, 0),
    ]:
        got = TA.elementwise(kind, a, sa, za, b, sb, zb, so, zo, "int8", rounding)
        ref = [
            _add_reference(kind, int(x), sa, za, int(y), sb, zb, so, zo, rounding != "tflite")
            for x, y in zip(a, b, strict=True)
        ]
        np.testing.assert_array_equal(got, np.array(ref, np.int8))


def test_elementwise_ties_differ_from_one_rounding():
    """-1.5 (lhs 0.5 * -2, rhs 0.25 * -2): TFLite's last RoundingDivideByPOT rounds the tie
    away from zero (-2); one half-up rounding of the exact sum gives -1."""
    args = (-1, 0.5, 1, -2, 0.25, 0, 1.0, 0)
    assert int(TA.elementwise("add", *args, rounding="tflite")) == -2
    assert int(TA.elementwise("add", *args, rounding="tflite_single")) == -1
    assert int(P.elementwise("add", *args, rounding="half_up")) == -1
    with pytest.raises(ValueError, match=r"tflite_arith\.elementwise"):
        P.elementwise("add", *args, rounding="tflite")


def test_layer_multiplier_takes_the_product_in_double():
    s_x, s_w, s_y = np.float32(0.0078431377), np.float32([0.0021, 0.0173]), np.float32(0.0151)
    m, shift = TA.layer_multiplier(s_x, s_w, s_y)
    for i in range(2):
        real = Fraction(float(s_x)) * Fraction(float(s_w[i])) / Fraction(float(s_y))
        # m * 2**(shift - 31) is the exact real multiplier to within half a unit of m
        err = abs(Fraction(int(m[i])) * Fraction(2) ** (int(shift[i]) - 31) - real)
        assert err <= Fraction(2) ** (int(shift[i]) - 32)
