"""float32 ``exp`` as a vectorizable TIR expression giving the same floats as the C library's
``expf`` that TVM's own ``exp`` calls on x86-64 Linux (one scalar libm call per element).

The algorithm is the published one of glibc >= 2.28 (ARM optimized-routines ``expf``): in
double precision, ``z = x * 32 / ln 2``; ``k = round(z)`` by adding and subtracting ``1.5 *
2**52``; ``r = z - k``; ``s = 2**(k / 32)`` built from a 32-entry table of ``2**(j / 32)``
(``j = k mod 32``) with ``k // 32`` added to the exponent bits; ``exp(x) = s * (1 + C2 r +
C1 r**2 + C0 r**3)`` evaluated with fused multiply-adds exactly as glibc's FMA variant (the
one x86-64 CPUs with FMA run) does, then rounded to float32. Written as TIR, the loop
vectorizes (16 lanes on AVX-512) instead of calling libm per element, and every result is
the same float: checked against TVM's ``exp`` over every float32 in ``[LOG_SMALLEST_NORMAL, 0]``
on the development machine, and in tests on random samples. The special-case branches of
libm (``|x| >= 88``, NaN, infinities) are not reproduced: callers clamp the argument
(softmax only needs ``x <= 0`` above the log of the smallest normal float).

>>> float(np.int64(EXPF_TABLE[0]).view(np.float64))
1.0
>>> float(np.int64(EXPF_TABLE[16] + (16 << 47)).view(np.float64)) == float(np.sqrt(2.0))
True
"""

from __future__ import annotations

import decimal

import numpy as np
from tvm import tirx

__all__ = ["EXPF_TABLE", "PERMUTE_LANES", "TABLE_BITS", "expf_expr"]

TABLE_BITS = 5
_N = 1 << TABLE_BITS
_INV_LN2_N = float.fromhex("0x1.71547652b82fep+0") * _N
PERMUTE_LANES = 8  # int64 lanes of an AVX-512 register: the vector width of the permuted lookup
_LANES = PERMUTE_LANES
_PERMUTE = "llvm.x86.avx512.vpermi2var.q.512"
_SHIFT = float.fromhex("0x1.8p52")  # adding it rounds a double of |value| < 2**51 to an integer
_C0 = float.fromhex("0x1.c6af84b912394p-5") / _N**3
_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _N**2
_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _N


def _table() -> np.ndarray:
    """The int64 bits of the double nearest ``2**(j / 32)`` minus ``j << 47`` (so that adding
    ``k << 47`` for ``k = 32 q + j`` gives ``2**(k / 32)``), j = 0..31."""
    ctx = decimal.Context(prec=50)
    ln2 = ctx.ln(decimal.Decimal(2))
    out = []
    for j in range(_N):
        v = float(ctx.exp(ctx.multiply(decimal.Decimal(j) / _N, ln2)))
        out.append(int(np.float64(v).view(np.int64)) - (j << (52 - TABLE_BITS)))
    return np.array(out, dtype=np.int64)


EXPF_TABLE = _table()


def _fma(a, b, c):
    return tirx.call_intrin("float64", "tirx.fma", a, b, c)


def _f64(v: float):
    return tirx.const(v, "float64")


def _permuted_entry(table, ki, lane):
    """``table[ki & 31]`` for the 8 lanes of a loop over ``lane`` vectorized by 8 (AVX-512):
    each half of the table is one 8 x int64 register pair that ``vpermi2q`` indexes by the
    low 4 bits of ``ki``, bit 4 picks the half. (A load at a computed index is scalarized
    by LLVM into a load and an insert per lane: most of a softmax's time.)"""

    def permute(first: int):
        return tirx.call_llvm_pure_intrin(
            "int64", _PERMUTE, table[first + lane], ki, table[first + _LANES + lane]
        )

    low = tirx.bitwise_and(ki, tirx.const(_N // 2, "int64")) == tirx.const(0, "int64")
    return tirx.Select(low, permute(0), permute(_N // 2))


def expf_expr(x, table, lane=None):
    """The float32 ``exp(x)`` of a float32 expression ``x`` (|x| < 88, not NaN) reading the
    int64 ``table`` buffer (:data:`EXPF_TABLE`, 32 entries). The expression repeats its
    sub-terms (no let-bindings: TVM's vectorizer mishandles lets); LLVM shares them.
    ``lane``: the variable of the innermost loop when it is vectorized by
    :data:`PERMUTE_LANES` on an AVX-512 target: the table is then read by permutes
    (:func:`_permuted_entry`, the same entries)."""
    xd = tirx.Cast("float64", x)
    kds = _fma(_f64(_INV_LN2_N), xd, _f64(_SHIFT))
    ki = tirx.reinterpret("int64", kds)
    kd = kds - _f64(_SHIFT)
    r = _fma(_f64(_INV_LN2_N), xd, -kd)
    entry = (
        table[tirx.bitwise_and(ki, tirx.const(_N - 1, "int64"))]
        if lane is None
        else _permuted_entry(table, ki, lane)
    )
    bits = entry + tirx.shift_left(ki, tirx.const(52 - TABLE_BITS, "int64"))
    s = tirx.reinterpret("float64", bits)
    z = _fma(r, _f64(_C0), _f64(_C1))
    y = _fma(r, _f64(_C2), _f64(1.0))
    return tirx.Cast("float32", _fma(z, r * r, y) * s)
