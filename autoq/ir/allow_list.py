"""The allow-list: ops that run in affine space without a pattern of their own.

One table, :data:`ALLOW_LIST`, ``op -> AllowRule``, read by simulate (patterns built from
its ``accumulate`` rows), realize (:func:`autoq.realization.propagate` applies each row's
integer rewrite) and the pre-quantized import. Adding an op is one row.

* ``commute`` rows: the op gives the same result on integers as on reals (monotone or pure
  data movement), so ``qnn.quantize`` can move above it and ``qnn.dequantize`` below it
  without changing any value. The simulated graph leaves the op in float; realize moves it
  into the integer domain with the row's ``integer`` rewrite.
* ``accumulate`` rows (mean, global average pool): simulate quantizes the input and sums
  integer-valued floats; realize emits ``qnn.sum`` with 1/N folded into the next scale.
  They are patterns (op type ``mean``) built from the table by ``patterns/mean.py``.

A row's ``integer(call, x, grid)`` returns the op applied to the integer tensor ``x`` on
``grid`` (its zero point, dtype and, when a quantize is moving up, the map from a real
value to its integer), ``x`` itself when the op is the identity on that grid (the binding
then disappears), or None when it cannot (the quantize/dequantize stays where it is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from autoq.ir.toolkit import const
from autoq.primitives import qrange

__all__ = ["ALLOW_LIST", "AllowRule", "Grid", "grid_point"]


@dataclass(frozen=True)
class Grid:
    """The integer grid a rewrite works on: ``zero_point``, ``dtype`` and, when known (a
    quantize moving up), ``of(real) -> int``, the grid point of a real value.

    ``axis``: None for one grid (per tensor, or a dequantize moving down with per-axis
    scales and one shared zero point); the channel axis of a per-axis quantize moving up,
    whose ``zero_point`` is then an int array and ``of`` gives one integer per channel."""

    zero_point: int | np.ndarray
    dtype: str
    of: Callable[[float], int | np.ndarray] | None = None
    axis: int | None = None


def _same_op(call, x, grid: Grid):
    return tvm.ir.Call(call.op, [x, *call.args[1:]], call.attrs, list(call.ty_args))


def _relu(call, x, grid: Grid):
    if grid.zero_point <= qrange(grid.dtype)[0]:
        return x  # every integer is >= the zero point: relu is the identity
    return relax.op.maximum(x, const(grid.zero_point, grid.dtype))


def _clip(call, x, grid: Grid):
    """``maximum(minimum(q, Q(hi)), Q(lo))``, each side dropped when its bound covers the
    grid (``Q(hi) == qmax``, ``Q(lo) == qmin``: the identity on every integer of the dtype);
    ``x`` itself when both do (a relu6 whose slot is calibrated on [0, 6], say). On a
    per-axis grid only that identity is taken (both bounds cover every channel's grid: a
    ReLU6 output calibrated per channel inside [0, 6]); per-channel bounds are not emitted,
    the clip then stays in float."""
    if grid.of is None:
        return None
    qmin, qmax = qrange(grid.dtype)
    lo = grid.of(float(call.args[1].value))
    hi = grid.of(float(call.args[2].value))
    keep_hi, keep_lo = bool(np.min(hi) < qmax), bool(np.max(lo) > qmin)
    if grid.axis is not None and (keep_hi or keep_lo):
        return None
    if keep_hi:
        x = relax.op.minimum(x, const(hi, grid.dtype))
    if keep_lo:
        x = relax.op.maximum(x, const(lo, grid.dtype))
    return x


def _pad(call, x, grid: Grid):
    a = call.attrs
    if str(a.pad_mode) != "constant":
        return None
    pv = float(a.pad_value)
    value = grid.zero_point if pv == 0.0 else (grid.of(pv) if grid.of is not None else None)
    if value is None:
        return None
    return relax.op.nn.pad(x, [int(v) for v in a.pad_width], "constant", float(value))


def _concat(call, fields, grid: Grid):
    return relax.op.concat(fields, axis=int(call.attrs.axis))


@dataclass(frozen=True)
class AllowRule:
    """How an op runs in affine space (see the module doc).

    ``integer``: the rewrite on integers. ``dequantize_below``: a ``qnn.dequantize`` may move
    below the op (exact for data movement, relu and max pool; not for clip, whose bounds
    need the *output* grid). ``dequantize_per_axis``: it may also move below with per-axis
    scales (the zero points all equal). ``quantize_per_axis``: a per-axis ``qnn.quantize``
    may move above it (``integer`` then gets the per-axis grid, see :class:`Grid`).
    ``operands``: what a quantize moving above it quantizes: ``"first"`` (the first
    argument), ``"fields"`` (each field of the tuple argument, concat) or ``"tuple"`` (the
    tuple op feeding a ``TupleGetItem``, split)."""

    kind: str
    integer: Callable | None = _same_op
    dequantize_below: bool = True
    dequantize_per_axis: bool = False
    quantize_per_axis: bool = False
    operands: str = "first"
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("commute", "accumulate"):
            raise ValueError(f"AllowRule.kind must be commute or accumulate, got {self.kind!r}")
        if self.operands not in ("first", "fields", "tuple"):
            raise ValueError(f"AllowRule.operands: unknown {self.operands!r}")


def _moves(doc: str, **kw) -> AllowRule:
    return AllowRule("commute", doc=doc, **kw)


ALLOW_LIST: dict[str, AllowRule] = {
    "relax.nn.relu": _moves("max(q, zero_point)", integer=_relu, dequantize_per_axis=True),
    "relax.clip": _moves(
        "clip(q, Q(lo), Q(hi)); a side whose bound covers the grid is dropped",
        integer=_clip,
        dequantize_below=False,
        quantize_per_axis=True,
    ),
    "relax.nn.max_pool2d": _moves("max pool on integers", dequantize_per_axis=True),
    "relax.reshape": _moves("same op on integers"),
    "relax.permute_dims": _moves("same op on integers"),
    "relax.squeeze": _moves("same op on integers"),
    "relax.expand_dims": _moves("same op on integers"),
    "relax.flatten": _moves("same op on integers"),
    "relax.strided_slice": _moves("same op on integers"),
    "relax.split": _moves(
        "same op on integers (quantize moves up)", dequantize_below=False, operands="tuple"
    ),
    "relax.concat": _moves(
        "each input quantized to the output's qparams",
        integer=_concat,
        dequantize_below=False,
        operands="fields",
    ),
    "relax.nn.pad": _moves("pad value Q(value) (zero_point for 0)", integer=_pad),
    "relax.mean": AllowRule("accumulate", integer=None, doc="qnn.sum, scale / N"),
    "relax.nn.adaptive_avg_pool2d": AllowRule(
        "accumulate", integer=None, doc="qnn.sum over H, W when the output is 1x1"
    ),
}


def grid_point(scale, zero_point, dtype: str) -> Callable[[float], int | np.ndarray]:
    """``of(real)``: the integer a quantize with these qparams gives a real value; for
    per-channel qparams (1-D arrays) an int array, one integer per channel.

    >>> grid_point(0.5, -3, "int8")(6.0)
    9
    >>> grid_point(np.array([0.5, 0.01], np.float32), np.array([-3, 0]), "int8")(6.0)
    array([  9, 127])
    """
    lo, hi = qrange(dtype)
    s = np.asarray(scale, np.float32)
    z = np.asarray(zero_point).astype(np.float32)  # integers: exact in float32

    def of(real: float) -> int | np.ndarray:
        v = np.clip(np.rint(np.float32(real) / s) + z, lo, hi)
        return int(v) if v.ndim == 0 else v.astype(np.int64)

    return of
