"""Fused elementwise kernels without the int8 round trips between their float stages.

A chain of float-rounding int8 ops fused into one function (open_nsfw's downsampling block:
three ``qnn.add`` and a ``qnn.requantize``) stores each stage's result as int8 and reads it
back: ``float32(int32(int8(clip(round(x / s) + z, lo, hi))) - z2)``. The clipped value is
already an integral float inside the int8 (uint8) range, so the casts give it back
unchanged and the zero point subtraction is exact in float32 too: the expression is
``clip(...) - float32(z2)``, the same bits. LLVM cannot prove that and emits a float to int
conversion, a narrowing, a widening and an int to float conversion on every stage's
critical path (about 30% of the kernel's time on one Sapphire Rapids core).
:func:`elide_round_trips` removes them from every block that stores one expression.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import SBlock, Schedule
from tvm.tirx import expr as E

__all__ = ["elide_round_trips"]

_RANGES = {"int8": (-128, 127), "uint8": (0, 255)}
_OFFSET_LIMIT = 2**23  # |zero point| below it: the int32 and float32 sums are exact
_BINARY = (E.Add, E.Sub, E.Mul, E.Div, E.Max, E.Min)


def _float_const(e) -> float | None:
    return float(e.value) if isinstance(e, E.FloatImm) else None


def _integral(e) -> bool:
    """Whether the float32 ``e`` is an integer (or infinite): a ``round``, an integer
    converted, or such a value plus an integral constant (a sum of integral floats rounds
    to an integral float)."""
    if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op):
        return e.op.name == "tirx.round"
    if isinstance(e, E.Cast):
        return str(e.value.ty).startswith(("int", "uint"))
    if isinstance(e, (E.Add, E.Sub)):
        c = _float_const(e.b)
        return c is not None and c == int(c) and _integral(e.a)
    return False


def _clipped(e, dtype: str) -> bool:
    """Whether ``e`` is ``max(min(v, hi), lo)`` with ``v`` integral and ``[lo, hi]`` integral
    bounds inside ``dtype``'s range: its conversion to ``dtype`` is exact."""
    if not (isinstance(e, E.Max) and isinstance(e.a, E.Min)) or dtype not in _RANGES:
        return False
    lo, hi = _float_const(e.b), _float_const(e.a.b)
    qmin, qmax = _RANGES[dtype]
    if lo is None or hi is None or lo != int(lo) or hi != int(hi):
        return False
    return qmin <= lo <= hi <= qmax and _integral(e.a.a)


def _narrowed(e):
    """``x`` when ``e`` is ``int32(int8(x))`` (or uint8) with ``x`` a clipped float, else None."""
    if not (isinstance(e, E.Cast) and str(e.ty) == "int32" and isinstance(e.value, E.Cast)):
        return None
    inner = e.value
    return inner.value if _clipped(inner.value, str(inner.ty)) else None


def _elide(e: E.Cast):
    """``e`` (a float32 cast) without the round trip, or None when it has none."""
    if str(e.ty) != "float32":
        return None
    v = e.value
    if (x := _narrowed(v)) is not None:
        return x
    if isinstance(v, (E.Add, E.Sub)) and isinstance(v.b, E.IntImm):
        x = _narrowed(v.a)
        if x is not None and abs(int(v.b.value)) < _OFFSET_LIMIT:
            return type(v)(x, tirx.const(float(v.b.value), "float32"))
    return None


def _rewrite(e):
    """``e`` with every round trip removed (the same object when there is none)."""
    if isinstance(e, E.Cast):
        v = _rewrite(e.value)
        e = e if v.same_as(e.value) else E.Cast(str(e.ty), v)
        new = _elide(e)
        return e if new is None else new
    if isinstance(e, _BINARY):
        a, b = _rewrite(e.a), _rewrite(e.b)
        return e if a.same_as(e.a) and b.same_as(e.b) else type(e)(a, b)
    if isinstance(e, tvm.ir.Call) and isinstance(e.op, tvm.ir.Op):
        args = [_rewrite(a) for a in e.args]
        if all(a.same_as(b) for a, b in zip(args, e.args, strict=True)):
            return e
        return tirx.call_intrin(str(e.ty), e.op.name, *args)
    return e


def elide_round_trips(sch: Schedule, block) -> None:
    """Remove the round trips from ``block``'s stored value (a block whose body is one
    ``BufferStore``; any other block is left as it is)."""
    stmt = sch.get(block)
    body = stmt.body
    if not isinstance(body, tirx.BufferStore) or stmt.init is not None:
        return
    value = _rewrite(body.value)
    if value.same_as(body.value):
        return
    store = tirx.BufferStore(body.buffer, value, body.indices)
    new = SBlock(
        stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, store,
        None, stmt.alloc_buffers, stmt.match_buffers, stmt.annotations,
    )  # fmt: skip
    sch.state.replace(sch.get_sref(block), new, {stmt: new})
