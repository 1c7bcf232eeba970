"""The requantize epilogue of a packed int8 kernel: int32 accumulator -> int8/uint8 in registers.

A conv2d / depthwise / dense kernel followed by ``add(bias)`` and ``qnn.requantize`` (the
chain ``realize`` emits) can apply both to its int32 accumulator before storing it, so that
the int32 tensor is never written to memory. :class:`Epilogue` describes that tail (the
optional int32 bias add, then the requantize with its rounding mode, output zero point and
saturation to the output dtype's range, which is where folded ReLU / ReLU6 clips live), and
:meth:`Epilogue.value` builds its TIR expression from the same TE helpers the ``qnn.requantize``
legalization uses (:mod:`autoq.qnn.tensor_exprs`), so the fused result is bit-identical; the
float rounding's round / zero point / clip tail is computed in fewer vector instructions by
:func:`round_clip` (8-bit outputs) and :func:`saturate_int32` (int32 outputs), each equal to
the legalization's for every float32 input but NaN (see their docstrings).

Every value (the bias, the scales, the zero points, the integer multipliers / shifts) is a
row of one int32 table ``[rows, channels]`` the kernel takes as an extra input (float32
scales bit-cast to int32; a scalar repeated along its row), except a zero input zero point
(an accumulator's), which stays an immediate for :func:`dequantize_value`'s int32 path. So
the kernel's code depends on the shapes, the rounding mode and which values are per channel,
never on the values themselves: layers of one shape share one compiled kernel (the Relax
``BlockBuilder`` adds a structurally equal PrimFunc once), whatever their qparams.

>>> e = Epilogue(np.array([1, 2], np.int32), (np.float32(0.5), 0, np.float32(1.0), 3),
...              "float", "int8", 2)
>>> e.rows
('bias', 's_in', 's_out', 'z_out')
>>> e.table()[[0, 3]].tolist(), e.table()[1].view(np.float32).tolist()
([[1, 2], [3, 3]], [0.5, 0.5])
>>> tail(None)(7, 0, None)  # no epilogue: the int32 value as it is
7
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import te, tirx

from autoq import primitives as P
from autoq.qnn.tensor_exprs import (
    clip_int64,
    dequantize_value,
    divide_by_reciprocal,
    fixed_point_multiply,
)

__all__ = [
    "Epilogue",
    "drop_params",
    "drop_table",
    "epilogue_compute",
    "float64_fixed_point",
    "round_clip",
    "saturate_int32",
    "table_shape",
    "tail",
]

# requantize operands in order: input scale, input zero point, output scale, output zero
# point, then (integer rounding modes) multiplier and shift
_NAMES = ("s_in", "z_in", "s_out", "z_out", "multiplier", "shift")
# r_out: RN(1 / s_out), float rounding where the division by s_out is done by reciprocal
_FLOATS = ("s_in", "s_out", "r_out")


@dataclass(frozen=True, eq=False)
class Epilogue:
    """``requantize(acc + bias)`` for ``channels`` output channels (``out_dtype`` int8 or
    uint8; int32 for the shortcut term of :class:`autoq.cpu.residual.Residual`).

    ``bias``: int32 ``[channels]`` or None. ``params``: the requantize operands in ``_NAMES``
    order (float32 scales, int32 zero points / multipliers / shifts), each a scalar or a
    ``[channels]`` array; the integer rounding modes need all six, ``float`` the first four.
    ``reciprocal`` (float rounding): divide by ``s_out`` as ``x * RN(1 / s_out)`` with the
    FMA corrections of :func:`autoq.primitives.reciprocal_division_steps` (the quotient of
    the division, bit for bit; its reciprocal a table row ``r_out``), or divide where
    those scales are out of its range; the division is slower on the AMX machine.
    ``codes``: the dtype of the 8-bit codes the requantize reads instead of an accumulator
    (a residual's shortcut): the corrections are then counted on every code
    (:func:`autoq.primitives.code_division_steps`).
    """

    bias: np.ndarray | None
    params: tuple
    rounding: str
    out_dtype: str
    channels: int
    reciprocal: bool = False
    codes: str | None = None

    def __post_init__(self):
        if self.rounding not in P.ROUNDING_MODES:
            raise ValueError(f"Epilogue: unknown rounding {self.rounding!r}")
        if self.out_dtype not in ("int8", "uint8", "int32"):
            raise ValueError(
                f"Epilogue: out_dtype must be int8, uint8 or int32, got {self.out_dtype!r}"
            )
        wanted = 4 if self.rounding == "float" else 6
        if len(self.params) != wanted:
            raise ValueError(f"Epilogue: {self.rounding} rounding takes {wanted} params")
        for name, v in self._named():
            if np.ndim(v) > 1 or np.size(v) not in (1, self.channels):
                raise ValueError(f"Epilogue: {name} must be a scalar or [{self.channels}]")

    def _named(self):
        named = list(zip(_NAMES, self.params, strict=False))
        if self.division_steps():
            named.insert(3, ("r_out", np.float32(1) / np.asarray(self.params[2], np.float32)))
        return named if self.bias is None else [("bias", self.bias), *named]

    def division_steps(self) -> int:
        """FMA corrections after ``* RN(1 / s_out)`` that give float32 ``r / s_out`` for
        every accumulator's real value ``r = (acc - z_in) * s_in``, or 0 (a division):
        :func:`autoq.primitives.reciprocal_division_steps` (float rounding only)."""
        if self.rounding != "float" or not self.reciprocal:
            return 0
        if self.codes is not None:
            s_in, z_in, s_out = self.params[:3]
            return P.code_division_steps(s_out, s_in, z_in, self.codes)
        return P.reciprocal_division_steps(self.params[2], self.params[0])

    @property
    def rows(self) -> tuple[str, ...]:
        """Names of the rows of :meth:`table`, in order: every value but a scalar ``z_in``
        of 0 (an immediate)."""
        return tuple(name for name, v in self._named() if not _immediate(name, v))

    def table(self) -> np.ndarray:
        """The int32 ``[max(1, len(rows)), channels]`` table of the values, a scalar repeated
        along its row (a row of zeros when there are none: the kernels take the table either
        way)."""
        out = np.zeros((max(1, len(self.rows)), self.channels), np.int32)
        values = dict(self._named())
        for r, name in enumerate(self.rows):
            dtype = np.float32 if name in _FLOATS else np.int32
            v = np.broadcast_to(np.asarray(values[name]).astype(dtype).reshape(-1), out[r].shape)
            out[r] = v.view(np.int32)
        return out

    def exact_in_float64(self, bound: int | None) -> bool:
        """Whether the half-even fixed-point requantize of every accumulator with ``|acc|
        <= bound`` is exact in float64: ``|acc + bias - z_in| * multiplier`` (times the
        left shift, if any) below 2**53, so the product, its power-of-two scaling and
        ``rint`` (ties to even) give :func:`fixed_point_multiply`'s integer."""
        if bound is None or self.rounding != "half_even" or self.out_dtype == "int32":
            return False
        z_in = int(np.abs(np.asarray(self.params[1], np.int64)).max())
        bias = 0 if self.bias is None else int(np.abs(self.bias.astype(np.int64)).max())
        m, shift = np.broadcast_arrays(
            np.abs(np.asarray(self.params[4], np.int64)).reshape(-1),
            np.asarray(self.params[5], np.int64).reshape(-1),
        )
        if np.abs(shift).max() >= 1000:  # (2**(shift - 31) a normal double)
            return False
        factor = max(int(mi) << max(int(si) - 31, 0) for mi, si in zip(m, shift, strict=True))
        return (bound + bias + z_in) * factor < 2**53

    def value(self, acc, channel, load, saturates: bool = True, bound: int | None = None):
        """The output value (``out_dtype``) of int32 ``acc`` in output channel ``channel``;
        ``load(row, channel)`` reads the table (an int32 PrimExpr). ``saturates=False``
        (float rounding; the caller proved the result always inside the output range):
        without the clip, which would never act. ``bound``: the largest ``|acc|`` the
        kernel produces; when :meth:`exact_in_float64` holds for it the half-even
        requantize runs in float64 lanes (:func:`float64_fixed_point`, the same integers in
        about a third of the int64 instructions)."""
        rows = self.rows

        def get(name, v):
            if name in rows:  # (a scalar from its row's first entry: loop invariant)
                x = load(rows.index(name), channel if np.size(v) != 1 else 0)
                return tirx.reinterpret("float32", x) if name in _FLOATS else x
            v = np.asarray(v).reshape(-1)[0]
            if name in _FLOATS:
                return tirx.const(float(np.float32(v)), "float32")
            return tirx.const(int(v), "int32")

        named = dict(self._named())
        if self.bias is not None:
            acc = acc + get("bias", self.bias)
        p = {n: get(n, named[n]) for n in _NAMES[: len(self.params)]}
        qmin, qmax = P.qrange(self.out_dtype)
        if self.rounding == "float":
            r = dequantize_value(acc, p["s_in"], p["z_in"])
            steps = self.division_steps()
            if steps:
                u = divide_by_reciprocal(r, p["s_out"], get("r_out", named["r_out"]), steps)
            else:
                u = r / p["s_out"]
            if self.out_dtype == "int32" and _is_zero(named["z_out"]):
                # a residual's shortcut on the accumulator grid (zero point 0): the round
                # is the conversion's (lrint)
                if not saturates:
                    return tirx.call_llvm_pure_intrin("int32", "llvm.lrint", u)
                return saturate_int32(u, rounded=False)
            if not saturates:
                return (te.round(u) + p["z_out"].astype("float32")).astype(self.out_dtype)
            if self.out_dtype != "int32":
                return round_clip(u, p["z_out"], qmin, qmax, self.out_dtype)
            # int32 outputs (a residual's shortcut on the accumulator grid)
            return saturate_int32(te.round(u) + p["z_out"].astype("float32"))
        if self.exact_in_float64(bound):
            return float64_fixed_point(acc, p, qmin, qmax, self.out_dtype)
        d = acc.astype("int64") - p["z_in"].astype("int64")
        y = fixed_point_multiply(d, p["multiplier"], p["shift"], self.rounding)
        return clip_int64(y + p["z_out"].astype("int64"), qmin, qmax, self.out_dtype)


def float64_fixed_point(acc, p: dict, qmin: int, qmax: int, dtype: str):
    """``clip(fixed_point_multiply(acc - z_in, m, shift, "half_even") + z_out)`` as ``dtype``
    in float64, for accumulators :meth:`Epilogue.exact_in_float64` proves exact:
    ``rint(double(acc - z_in) * (m * 2**(shift - 31)))`` (one exact product: the integer
    ``(acc - z_in) * m`` has at most 53 significant bits and the factor is ``m`` times a
    power of two) plus ``z_out``, clamped to ``[qmin, qmax]``. ``p``: the requantize
    operands by name (int32 PrimExprs)."""
    f64 = "float64"
    x = acc.astype(f64) - p["z_in"].astype(f64)
    # 2**(shift - 31) from its exponent bits (|shift| < 1000: a normal double)
    power = tirx.reinterpret(
        f64, tirx.shift_left(p["shift"].astype("int64") + (1023 - 31), tirx.const(52, "int64"))
    )
    y = tirx.call_llvm_pure_intrin(f64, "llvm.rint", x * (p["multiplier"].astype(f64) * power))
    t = te.min(
        te.max(y + p["z_out"].astype(f64), tirx.const(float(qmin), f64)),
        tirx.const(float(qmax), f64),
    )
    return t.astype("int32").astype(dtype)


def round_clip(u, z, qmin: int, qmax: int, dtype: str):
    """``clip(round_half_even(u) + z, qmin, qmax)`` as ``dtype`` (float32 ``u``, int32 ``z``),
    the float requantize's last steps, computed as ``lrint(clip(u, qmin - z, qmax - z)) + z``:
    on x86 a clamp and one ``vcvtps2dq`` (which rounds half to even) instead of a round, an
    add, a clamp and a truncating conversion (ResNet-50's conv kernels 0.975x the time on
    Zen 5). Bit-identical to :func:`autoq.qnn.tensor_exprs.quantize_value`: a clamp to integer
    bounds commutes with rounding, ``qmin - z`` and ``qmax - z`` are exact in float32, and
    where ``round(u) + z`` is inexact in float32 (beyond 2**24) both clamp to the same bound.
    For 8-bit ``dtype`` (``|z| < 2**24``); NaN ``u`` (a zero scale) is not defined.
    """
    zf = z.astype("float32")
    lo = tirx.const(float(qmin), "float32") - zf
    hi = tirx.const(float(qmax), "float32") - zf
    t = te.min(te.max(u, lo), hi)
    return (tirx.call_llvm_pure_intrin("int32", "llvm.lrint", t) + z).astype(dtype)


def saturate_int32(v, rounded: bool = True):
    """Integral float32 ``v`` clipped to the int32 range and converted, exactly as the
    ``qnn.requantize`` legalization's float64 clip (:func:`autoq.qnn.tensor_exprs.quantize_value`
    with ``clip_dtype="float64"``) does, in float32 lanes: ``v`` clamped to
    ``[-2**31, 2**31 - 128]`` (the largest float32 below 2**31) and converted, and
    ``2**31 - 1`` where ``v >= 2**31`` (float32 has no value between those two bounds; the
    float64 path widens, clips and converts twice as many lanes: the one saturating residual
    conv of ResNet-50 took 1.5x the time of an equal non-saturating one).
    ``rounded=False``: ``v`` is not yet rounded and the result is that of
    ``round_half_even(v)``: the clamp to integer bounds commutes with the rounding, which
    the conversion then does (``lrint``), and every float32 from 2**31 up is an integer.
    """
    top = tirx.const(2.0**31, "float32")
    t = te.min(te.max(v, tirx.const(-(2.0**31), "float32")), tirx.const(2.0**31 - 128, "float32"))
    t = t.astype("int32") if rounded else tirx.call_llvm_pure_intrin("int32", "llvm.lrint", t)
    return tirx.Select(v >= top, tirx.const(2**31 - 1, "int32"), t)


def _is_zero(v) -> bool:
    """Whether the operand ``v`` is a scalar 0."""
    return np.size(v) == 1 and not np.any(v)


def _immediate(name: str, v) -> bool:
    """Whether the value ``name`` stays an immediate instead of a table row: a scalar input
    zero point 0 (the accumulator's; :func:`dequantize_value` skips its subtraction)."""
    return name == "z_in" and _is_zero(v)


def epilogue_compute(
    shape, value, axis: int, epilogue: Epilogue | None, inputs: list, bound: int | None = None
):
    """The kernel's ``autoq_out`` TE stage: ``value(*index)`` (the int32 accumulator), or,
    with an ``epilogue``, its requantized value for the channel ``index[axis]``; the
    epilogue's table placeholder is appended to ``inputs``. ``bound``: see
    :meth:`Epilogue.value`."""
    if epilogue is None:
        return te.compute(shape, value, name="autoq_out")
    table = te.placeholder(epilogue.table().shape, "int32", name="epilogue")
    inputs.append(table)

    def f(*i):
        return epilogue.value(value(*i), i[axis], lambda r, ch: table[r, ch], bound=bound)

    return te.compute(shape, f, name="autoq_out")


def tail(epilogue: Epilogue | None, bound: int | None = None):
    """For TVMScript kernels: ``f(int32 value, channel, table buffer)`` -> the stored value
    (``value`` itself without an epilogue); ``bound``: see :meth:`Epilogue.value`."""
    if epilogue is None:
        return lambda v, _channel, _table: v
    return lambda v, channel, table: epilogue.value(
        v, channel, lambda r, k: table[r, k], bound=bound
    )


def table_shape(epilogue: Epilogue | None, channels: int) -> tuple[int, int]:
    """Shape of the table buffer of a TVMScript kernel (a dummy ``[1, channels]`` without an
    epilogue; :func:`drop_table` removes it then)."""
    return (1, channels) if epilogue is None else epilogue.table().shape


def drop_table(func, epilogue: Epilogue | None, index: int):
    """``func`` without its table parameter ``index`` when there is no epilogue."""
    # its buffer is never read: tail(None) ignores the table
    return func if epilogue is not None else drop_params(func, (index,))


def drop_params(func, indices):
    """``func`` without the parameters at ``indices`` (buffers its body never reads)."""
    drop = set(indices)
    params = [p for i, p in enumerate(func.params) if i not in drop]
    return tirx.PrimFunc(params, func.body, func.ret_type, func.attrs)
