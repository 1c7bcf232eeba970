"""TFLite's integer kernels as numpy primitives: what ``rounding="tflite"`` (and
``"tflite_single"``) computes where a TFLite kernel does more than one requantize.

A requantize in the ``tflite`` modes is TFLite's ``MultiplyByQuantizedMultiplier``
(:func:`autoq.primitives.fixed_point_multiply`). TFLite's kernels differ from "one requantize
of the exact result" in four places, and these functions are the references the ``qnn``
legalizations and the realize stage follow under those modes (bit-exact with LiteRT's
kernels, tests/test_import_tflite.py):

* **conv / depthwise / fully connected**: the multiplier is ``double(s_x) * double(s_w) /
  double(s_y)`` (:func:`layer_multiplier`), not the float32 product ``s_x * s_w`` that the
  canonical graph carries as the accumulator's scale (they differ in the last bits of
  nearly every multiplier, and then in ~0.1% of the outputs).
* **ADD / SUB** (:func:`elementwise`): both operands minus their zero points are shifted left
  by 20 bits (15 for 16-bit inputs), each rescaled by its own multiplier (``s_i / (2 *
  max(s_a, s_b))``), summed, and the sum rescaled by ``2 * max(s_a, s_b) / (2**20 * s_y)``:
  three roundings. **MUL**: one ``MultiplyByQuantizedMultiplier`` of the product of the
  centered operands by ``s_a * s_b / s_y``. ``qnn.add``/``subtract``/``multiply`` follow
  this under ``tflite``; under ``tflite_single`` they keep one rounding of the exact result
  (ties up), :func:`elementwise` is the reference of TFLite's single-rounding build.
* **MEAN** (:func:`mean_multiplier`): ``sum(q - zp)`` times the multiplier of ``s_x / s_y``
  with ``1 / N`` folded in by an integer division.
* **AVERAGE_POOL_2D** (:func:`divide_round_away`): ``sum(q)`` of the *raw* integers divided
  by the window count, rounded half away from zero (input and output share their qparams).
  The canonical form computes it as a window sum with zero point 0 followed by a
  ``half_away`` requantize whose multiplier is ``ceil(2**T / N)`` (:func:`average_multiplier`):
  exactly the same integers.

Multipliers come from :func:`autoq.primitives.quantize_multiplier` (TFLite's
``QuantizeMultiplier``: frexp, ``round(frac * 2**31)``; it rounds a tie to even where
TFLite's ``std::round`` rounds it away, which needs a fraction with exactly 32 significant
bits and was never seen on real scales).
"""

from __future__ import annotations

import numpy as np

from autoq.primitives import fixed_point_multiply, qrange, quantize_multiplier

__all__ = [
    "TFLITE_MODES",
    "average_multiplier",
    "divide_round_away",
    "elementwise",
    "elementwise_multipliers",
    "elementwise_operands",
    "elementwise_output",
    "layer_multiplier",
    "left_shift",
    "mean_multiplier",
]

#: the rounding modes that follow TFLite's kernels
TFLITE_MODES = ("tflite", "tflite_single")


def _f64(x) -> np.ndarray:
    """A float32 scale as TFLite reads it into a double."""
    return np.asarray(x, np.float32).astype(np.float64)


def layer_multiplier(input_scale, weight_scale, output_scale) -> tuple[np.ndarray, np.ndarray]:
    """TFLite's conv / depthwise / fully-connected requantize multiplier (per channel):
    ``double(s_x) * double(s_w) / double(s_y)``, the product taken in double.

    The float32 product of 0.1 and 0.3 loses the bits the double keeps: the multipliers of
    ``0.1 * 0.3 / 0.5`` differ by 31 units (of 2**31):

    >>> [int(v) for v in layer_multiplier(0.1, 0.3, 0.5)]
    [2061584415, -4]
    >>> s_acc = np.float64(np.float32(0.1) * np.float32(0.3))
    >>> [int(v) for v in quantize_multiplier(s_acc / np.float64(np.float32(0.5)))]
    [2061584384, -4]
    """
    return quantize_multiplier(_f64(input_scale) * _f64(weight_scale) / _f64(output_scale))


def mean_multiplier(input_scale, output_scale, count: int) -> tuple[int, int]:
    """TFLite's MEAN (``QuantizedMeanOrSum``): the multiplier ``m0 * 2**(e - 31)`` of
    ``s_x / s_y`` with ``1 / count`` folded in by an integer division:
    ``k = min(floor(log2 count), 32, 31 + e)``, ``m = (m0 << k) // count``, shift ``e - k``.
    Applied to ``sum(q - zp_x)`` with :func:`autoq.primitives.fixed_point_multiply`.

    s_x = s_y and count 64: ``m0 = 2**30``, e = 1; k = 6, m = 2**36 // 64 = 2**30, shift -5:
    1/64 exactly. count 3: k = 1, m = 2**31 // 3 = 715827882 (rounded down), shift 0:

    >>> mean_multiplier(0.5, 0.5, 64), mean_multiplier(0.5, 0.5, 3)
    ((1073741824, -5), (715827882, 0))
    """
    m0, e = (int(v) for v in quantize_multiplier(_f64(input_scale) / _f64(output_scale)))
    k = min(int(count).bit_length() - 1, 32, 31 + e)
    return (m0 << k) // int(count), e - k


def divide_round_away(total, count) -> np.ndarray:
    """TFLite's AVERAGE_POOL_2D rounding: ``total / count`` to the nearest integer, ties away
    from zero, in integer arithmetic (``(total + count // 2) // count`` for positive totals,
    the mirror image for negative ones; C's division truncates toward zero).

    Ties exist only for even counts: 6 / 4 = 1.5 -> 2, -6 / 4 = -1.5 -> -2 (half-even would
    give 2 and -2, half-up 2 and -1); 5 / 4 = 1.25 -> 1, -7 / 4 = -1.75 -> -2; with count 3,
    4 / 3 = 1.33 -> 1 and -5 / 3 = -1.67 -> -2:

    >>> divide_round_away(np.array([6, -6, 5, -7]), 4).tolist()
    [2, -2, 1, -2]
    >>> divide_round_away(np.array([4, -5, 0]), 3).tolist()
    [1, -2, 0]
    """
    t = np.asarray(total, np.int64)
    n = np.int64(count)
    mag = (np.abs(t) + n // 2) // n
    return np.where(t > 0, mag, -mag)


def average_multiplier(count: int) -> tuple[int, int]:
    """Multiplier and shift with which a ``half_away`` :func:`fixed_point_multiply` of a
    window sum ``S`` (|S| <= 255 * count) is exactly :func:`divide_round_away` (S, count).

    ``m = ceil(2**T / count)`` in ``[2**30, 2**31)`` (shift ``31 - T``): exact for a power of
    two; otherwise slightly above ``1 / count``, which rounds an exact tie ``k + 1/2`` (even
    counts) away from zero like TFLite, and moves no other value across a rounding boundary:
    the error ``|S| * (m / 2**T - 1 / count) < 255 * count / 2**T`` stays below the
    ``1 / (2 * count)`` that separates ``S / count`` from the nearest boundary while
    ``count < 2**21`` (``2**T >= 2**30 * count``).

    >>> average_multiplier(4), average_multiplier(6)
    ((1073741824, -1), (1431655766, -2))
    >>> m, s = average_multiplier(6)
    >>> [int(fixed_point_multiply(v, m, s, "half_away")) for v in (3, -3, 9, -9, 8)]
    [1, -1, 2, -2, 1]
    """
    n = int(count)
    if not 1 <= n < 2**21:
        raise ValueError(f"average pool window count must be in [1, 2**21), got {n}")
    t = 30 + (n - 1).bit_length()  # 2**T / n in [2**30, 2**31)
    return -(-(1 << t) // n), 31 - t


def left_shift(input_dtypes) -> int:
    """TFLite ADD/SUB's left shift: 20 bits for 8-bit operands, 15 when an operand is 16-bit
    (65535 << 15 still fits an int32).

    >>> left_shift(["int8", "uint8"]), left_shift(["int16", "int16"])
    (20, 15)
    """
    return 15 if any(str(d) in ("int16", "uint16") for d in input_dtypes) else 20


def elementwise_multipliers(kind: str, lhs_scale, rhs_scale, out_scale, shift: int = 20) -> list:
    """TFLite's ``[(m, shift), ...]`` for ADD/SUB (lhs, rhs, output: three) or MUL (one),
    computed in double from the float32 scales as TFLite's ``Prepare`` does.

    add with s_a = 0.5, s_b = 0.25, s_y = 1: ``2 * max = 1``; 0.5 -> (2**30, 0), 0.25 ->
    (2**30, -1), output 1 / 2**20 -> (2**30, -19):

    >>> elementwise_multipliers("add", 0.5, 0.25, 1.0)
    [(1073741824, 0), (1073741824, -1), (1073741824, -19)]
    >>> elementwise_multipliers("multiply", 0.5, 0.25, 8.0)
    [(1073741824, -5)]
    """
    sa, sb, so = _f64(lhs_scale), _f64(rhs_scale), _f64(out_scale)
    if kind == "multiply":
        reals = [sa * sb / so]
    elif kind in ("add", "subtract"):
        twice = 2.0 * max(sa, sb)
        reals = [sa / twice, sb / twice, twice / (float(1 << shift) * so)]
    else:
        raise ValueError(f"unknown elementwise op {kind!r}; expected add, subtract or multiply")
    return [tuple(int(v) for v in quantize_multiplier(r)) for r in reals]


def elementwise_operands(kind: str, da, db, multipliers: list, multiply, shift: int = 20):
    """TFLite's ADD/SUB/MUL, first step, on the centered operands ``da``, ``db``: the raw sum
    (difference) of the two operands each shifted left by ``shift`` and rescaled by its own
    multiplier, or the raw product for MUL. ``multiply(x, m, shift)`` is the mode's
    ``MultiplyByQuantizedMultiplier`` (numpy here, a TIR expression in the ``qnn``
    legalization: both build the same arithmetic, in two stages).

    >>> mults = elementwise_multipliers("add", 0.5, 0.25, 1.0)
    >>> mul = lambda x, m, s: fixed_point_multiply(x, m, s, "tflite")
    >>> raw = elementwise_operands("add", np.array([3, -3]), np.array([1, -1]), mults, mul)
    >>> (raw / 2**19).tolist(), elementwise_output("add", raw, mults, mul).tolist()
    ([3.5, -3.5], [2, -2])
    """
    if kind == "multiply":
        return da * db
    (ma, sa), (mb, sb), _ = multipliers
    a = multiply(da * (1 << shift), ma, sa)
    b = multiply(db * (1 << shift), mb, sb)
    return a + b if kind == "add" else a - b


def elementwise_output(kind: str, raw, multipliers: list, multiply):
    """TFLite's ADD/SUB/MUL, second step: the raw value of :func:`elementwise_operands`
    rescaled to the output (before its zero point)."""
    m, s = multipliers[-1]
    return multiply(raw, m, s)


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
    rounding: str = "tflite",
) -> np.ndarray:
    """Reference for ``qnn.add`` / ``subtract`` / ``multiply`` in the ``tflite`` modes:
    TFLite's kernels (module doc), saturated to ``dtype``.

    0.5 * (3 - 1) + 0.25 * (2 - 0) = 1.5 at output scale 1.0, a tie (both operand terms are
    exact after their 20-bit shift, the tie is met by the last rounding): 2 in both modes;
    -1.5 goes to -2 under ``tflite`` (the last step is gemmlowp's ``RoundingDivideByPOT``,
    ties away from zero) and to -1 under ``tflite_single`` (one rounding, ties toward +inf):

    >>> [int(elementwise("add", 3, 0.5, 1, 2, 0.25, 0, 1.0, 0, rounding=r))
    ...  for r in ("tflite", "tflite_single")]
    [2, 2]
    >>> [int(elementwise("add", -1, 0.5, 1, -2, 0.25, 0, 1.0, 0, rounding=r))
    ...  for r in ("tflite", "tflite_single")]
    [-2, -1]
    """
    if rounding not in TFLITE_MODES:
        raise ValueError(f"rounding must be one of {TFLITE_MODES}, got {rounding!r}")
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    shift = left_shift([lhs.dtype, rhs.dtype])
    mults = elementwise_multipliers(kind, lhs_scale, rhs_scale, out_scale, shift)
    da = lhs.astype(np.int64) - np.int64(lhs_zero_point)
    db = rhs.astype(np.int64) - np.int64(rhs_zero_point)

    def multiply(x, m, s):
        return fixed_point_multiply(x, m, s, rounding)

    raw = elementwise_operands(kind, da, db, mults, multiply, shift)
    y = elementwise_output(kind, raw, mults, multiply) + np.int64(out_zero_point)
    qmin, qmax = qrange(dtype)
    return np.clip(y, qmin, qmax).astype(dtype)
