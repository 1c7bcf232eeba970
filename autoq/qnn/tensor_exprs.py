"""The TE expressions the ``qnn.*`` legalizations are built from.

The same expressions serve the real ops and the simulated ones, so that the simulated graph
predicts the integer graph bit for bit; the integer requantize math mirrors
:func:`autoq.primitives.fixed_point_multiply` and :func:`autoq.primitives.rounding_right_shift`.
"""

from __future__ import annotations

from tvm import relax, te, tirx

from autoq.ir.toolkit import const_array, dtype_of, shape_of
from autoq.qnn.checks import QnnError, static_int

__all__ = [
    "call_te",
    "call_te_any_shape",
    "clip_int64",
    "dequantize_tensor",
    "dequantize_value",
    "divide_by_reciprocal",
    "fixed_point_multiply",
    "param_at",
    "product",
    "quantize_tensor",
    "quantize_value",
    "rshift_round",
]


def param_at(p, idx, axis):
    """Value of a scalar / per-axis parameter (TE tensor or Python number) at index idx."""
    if not isinstance(p, te.Tensor):  # a Python number or an immediate
        return p
    if len(p.shape) == 0:
        return p[()]
    if static_int(p.shape[0]) == 1:
        return p[0]
    return p[idx[axis % len(idx)]]


def _scalar_or_tensor(expr):
    """Pass scalar constants to TE as immediates (simpler code), everything else as tensors."""
    v = const_array(expr)
    if v is not None and v.ndim == 0:
        return tirx.const(v.item(), str(v.dtype))
    return expr


def call_te(bb, fn, data, params, name: str):
    """``bb.call_te(fn, *data, *params)``: scalar constant ``params`` become immediates."""
    args = [*data, *(_scalar_or_tensor(p) for p in params)]
    return bb.call_te(fn, *args, primfunc_name_hint=name)


def _any_shape(expr, name: str, every_dim: bool) -> te.Tensor:
    """A placeholder of ``expr``'s rank and dtype whose dimensions (``every_dim``) or
    dimensions other than 1 are symbolic (a parameter's dimension 1 stays:
    :func:`param_at` reads a one-element parameter at index 0)."""
    one = tirx.IntImm("int64", 1)
    dims = [
        one if d == 1 and not every_dim else tirx.Var(f"{name}_{k}", "int64")
        for k, d in enumerate(shape_of(expr))
    ]
    return te.placeholder(dims, dtype_of(expr), name=name)


def call_te_any_shape(bb, fn, data, params, name: str):
    """:func:`call_te` for an elementwise ``fn`` (its output has ``data[0]``'s shape), with
    one PrimFunc for every shape of the same ranks: the data's dimensions and the
    parameters' dimensions other than 1 are symbolic in the PrimFunc (bound from the
    arguments when it runs), and scalar constant parameters are rank-0 tensors, so that ops
    that differ only in their shapes or qparam values (every layer's activation or weight
    quantize) call one compiled kernel instead of one each. Tensors of unknown shape:
    :func:`call_te`."""
    args = [*data, *params]
    if any(shape_of(a) is None for a in args):
        return call_te(bb, fn, data, params, name)
    holders = [_any_shape(a, f"arg{k}", k < len(data)) for k, a in enumerate(args)]
    out = fn(*holders)
    gv = bb.add_func(te.create_prim_func([*holders, out], "int64"), name)
    return relax.call_tir(gv, args, out_ty=relax.TensorType(shape_of(data[0]), out.dtype))


def fma(a, b, c):
    """float32 ``a * b + c`` rounded once (``llvm.fma``: a real FMA, never split)."""
    return tirx.call_intrin("float32", "tirx.fma", a, b, c)


def product(a, s):
    """float32 ``a * s`` rounded on its own, as numpy rounds it, whatever adds it later:
    ``fma(a, s, +0.0)``. TVM's LLVM target contracts ``a * s + c`` into one fused
    multiply-add wherever it can (``AllowFPOpFusion = Fast`` in its ``llvm_instance.cc``, no
    target attribute turns it off): a float ``qnn.add``'s ``fma(b - zb, sb, (a - za) * sa)``
    is one output step off :func:`autoq.primitives.elementwise` wherever the real result is
    a tie. LLVM contracts multiplies only, and folds ``fma(a, s, +0.0)`` into one only under
    ``nsz`` (TVM sets no fast-math flags): the same value (a ``-0.0`` product becomes
    ``+0.0``, which no sum or quantize tells apart) in one ``vfmadd``, as cheap as the
    ``vmulps``. (``llvm.arithmetic.fence`` around the product gives the same values, but
    made ResNet-50's fused float ``qnn.add`` chains 25-60x slower.)"""
    return fma(a, s, tirx.const(0.0, "float32"))


def divide_by_reciprocal(x, s, r, steps: int):
    """float32 ``x / s`` as ``x * r`` and ``steps`` FMA corrections, ``r = RN(1 / s)``: the
    same value as the division where :func:`autoq.primitives.reciprocal_division_steps`
    gives ``steps`` (its numpy twin: :func:`autoq.primitives.divide_by_reciprocal`)."""
    y = x * r
    for _ in range(steps):
        y = fma(fma(-y, s, x), r, y)
    return y


def quantize_value(x, s, z, qmin, qmax, clip_dtype="float32", quotient=None):
    """float32 ``clip(round_half_even(x / s) + z, qmin, qmax)`` (still a float).

    ``clip_dtype="float64"`` clips in float64, for int32 outputs: float32 cannot hold
    2**31 - 1, and converting the float32 bound 2**31 to int32 overflows. ``quotient``:
    ``x / s`` computed another way (the same value: :func:`divide_by_reciprocal`).
    """
    v = te.round(x / s if quotient is None else quotient) + z.astype("float32")
    if clip_dtype != "float32":
        v = v.astype(clip_dtype)
    return te.max(
        te.min(v, tirx.const(float(qmax), clip_dtype)), tirx.const(float(qmin), clip_dtype)
    )


def dequantize_value(q, s, z):
    """``float32(q - z) * s``, a :func:`product` (never contracted into a later addition: as
    primitives.dequantize rounds it); q is any int dtype or an integral float.

    The subtraction is exact: in int32 for 8/16-bit data, in int64 for int32 data (an int32
    accumulator minus a zero point can leave the int32 range), like primitives.dequantize;
    none for a constant zero point 0 (an accumulator's: the same integer converted, without
    int64 lanes, which halve the vector width).
    """
    dtype = str(q.dtype if hasattr(q, "dtype") else q.ty)  # a tensor element or any PrimExpr
    if "float" in dtype:
        return product((q - z.astype(dtype)).astype("float32"), s)
    if isinstance(z, tirx.IntImm) and z.value == 0:
        return product(q.astype("float32"), s)
    wide = "int64" if dtype == "int32" else "int32"
    return product((q.astype(wide) - z.astype(wide)).astype("float32"), s)


def quantize_tensor(x, s, z, axis, out_dtype, qmin, qmax):
    def f(*i):
        v = quantize_value(x[i], param_at(s, i, axis), param_at(z, i, axis), qmin, qmax)
        return v.astype(out_dtype)

    return te.compute(x.shape, f, name="quantize")


def dequantize_tensor(q, s, z, axis):
    return te.compute(
        q.shape,
        lambda *i: dequantize_value(q[i], param_at(s, i, axis), param_at(z, i, axis)),
        name="dequantize",
    )


def clip_int64(y, qmin: int, qmax: int, out_dtype: str):
    """An int64 value saturated to ``[qmin, qmax]`` and cast to ``out_dtype``."""
    return te.max(te.min(y, tirx.const(qmax, "int64")), tirx.const(qmin, "int64")).astype(out_dtype)


def _constant_rshift_round(x, shift: int, mode):
    """:func:`rshift_round` for a constant ``shift`` >= 1: one add and one shift,
    ``(x + bias) >> shift`` with ``bias = 2**(shift - 1)`` less 1 where a tie rounds down
    (half_even: ``floor`` even; half_away: ``x < 0``). ``x + bias`` reaches ``2**shift``
    exactly when ``x``'s remainder is at least ``half`` (half_up), above it, or equal with
    the tie going up: the same values as the general form, which LLVM vectorizes poorly
    (all-MiniLM-L6-v2's 12 x 128 x 128 mask add with its dequantize: 125 -> 78 us, 1 thread).

    >>> from tvm.sym.analyzer import Analyzer
    >>> ints = [tirx.const(v, "int64") for v in (-3, -2, -1, 1, 2, 3, 5)]
    >>> [int(Analyzer().simplify(_constant_rshift_round(v, 1, "half_even"))) for v in ints]
    [-2, -1, 0, 0, 1, 2, 2]
    """
    one = tirx.const(1, "int64")
    bias = tirx.const(1 << (shift - 1), "int64")
    n = tirx.const(shift, "int64")
    if mode == "half_up":
        return (x + bias) >> n
    if mode == "half_away":
        zero = tirx.const(0, "int64")
        return (x + bias - tirx.Select(x < zero, one, zero)) >> n
    if mode == "half_even":
        return (x + (bias - one) + ((x >> n) & one)) >> n
    raise QnnError(f"unknown tie rule {mode!r}")


def rshift_round(x, shift, mode):
    """int64 ``round(x / 2**shift)`` with a tie rule (shift >= 0, an int64 PrimExpr)."""
    if isinstance(shift, tirx.IntImm) and 1 <= shift.value <= 62:
        return _constant_rshift_round(x, int(shift.value), mode)
    one = tirx.const(1, "int64")
    zero = tirx.const(0, "int64")
    floor = x >> shift
    rem = x - (floor << shift)
    # te.max keeps the shift amount non-negative in the branch Select does not take: with a
    # constant shift of 0, ``one << (shift - one)`` would be folded to an invalid ``1 << -1``
    half = tirx.Select(shift > zero, one << te.max(shift - one, zero), zero)
    if mode == "half_up":
        up = rem >= half
    elif mode == "half_away":
        up = tirx.Or(rem > half, tirx.And(rem == half, x >= zero))
    elif mode == "half_even":
        up = tirx.Or(rem > half, tirx.And(rem == half, (floor & one) == one))
    else:
        raise QnnError(f"unknown tie rule {mode!r}")
    return floor + tirx.Select(tirx.And(up, shift > zero), one, zero)


def fixed_point_multiply(x, m, shift, rounding):
    """Mirror of :func:`autoq.primitives.fixed_point_multiply` on int64 PrimExprs."""
    i64 = "int64"
    x = x.astype(i64)
    m = m.astype(i64)
    shift = shift.astype(i64)
    zero = tirx.const(0, i64)
    if rounding == "tflite":
        left = te.max(shift, zero)
        right = te.max(-shift, zero)
        lo, hi = tirx.const(-(2**31), i64), tirx.const(2**31 - 1, i64)
        # each intermediate appears once or twice: TFLite's ADD nests three of these, and
        # an expression that copies its operand many times takes minutes to simplify
        xs = te.max(te.min(x << left, hi), lo)
        # gemmlowp's doubling high multiply: (ab + nudge) / 2**31 truncated toward zero, with
        # nudge 2**30 (ab >= 0) or 1 - 2**30 (ab < 0), is floor((ab + 2**30) / 2**31) in both
        # cases (m >= 0 never meets the saturating case m = xs = -2**31)
        high = (xs * m + tirx.const(1 << 30, i64)) >> tirx.const(31, i64)
        # RoundingDivideByPOT, ties away from zero: floor((high + half - [high < 0]) / 2**right)
        half = (tirx.const(1, i64) << right) >> tirx.const(1, i64)
        neg = tirx.Select(tirx.And(high < zero, right > zero), tirx.const(1, i64), zero)
        return (high + half - neg) >> right
    mode = "half_up" if rounding == "tflite_single" else rounding
    total = tirx.const(31, i64) - shift
    prod = x * m
    return tirx.Select(
        total < zero,
        prod << te.max(-total, zero),
        rshift_round(prod, te.max(total, zero), mode),
    )
