"""The residual add of a conv in the conv kernel's epilogue.

``realize`` writes a conv with a residual add (``conv2d_bias_add`` / ``conv2d_add``) as ::

    acc = qnn.conv2d(x, w)                                   # int32
    acc = add(acc, bias)                                     # optional
    acc = add(acc, qnn.requantize(shortcut, s_r, z_r, s_acc, 0, out_dtype=int32))
    out = qnn.requantize(acc, s_acc, 0, s_out, z_out)        # a folded ReLU / clip: its range

:func:`residual_chain` finds that chain (every intermediate with one user) and
:class:`Residual` describes its shortcut term, ``requantize(shortcut)`` onto the
accumulator's int32 grid: the conv kernel (:func:`add_shortcut`) reads the shortcut, in NCHW
or in the blocked layout of :mod:`autoq.cpu.blocked` its producer stores, and adds that term to
the accumulator before the epilogue's bias and requantize, with the same TE helpers as the
``qnn.requantize`` legalization, so the fused result is bit-identical. The int32 accumulator,
the shortcut's int32 copy and their sum are never written to memory, and the block's output
can be stored blocked for the next block's convs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tvm import relax, te

from autoq import primitives as P
from autoq.cpu.blocked import BlockedLayout
from autoq.cpu.epilogue import Epilogue
from autoq.cpu.tiling import i64
from autoq.ir.toolkit import dtype_of, is_call, shape_of

__all__ = [
    "Residual",
    "ResidualChain",
    "add_shortcut",
    "residual_chain",
    "shortcut_load",
    "shortcut_term",
]

_SHORTCUT_DTYPES = ("int8", "uint8")


@dataclass(frozen=True, eq=False)
class Residual:
    """The shortcut term of a residual epilogue: ``shortcut`` (an int32 :class:`Epilogue`
    without bias: the requantize onto the accumulator grid) of a ``dtype`` tensor read in
    ``layout`` (its stored value is ``value + layout.shift``), or NCHW when None."""

    shortcut: Epilogue
    dtype: str
    layout: BlockedLayout | None = None

    def __post_init__(self):
        if self.dtype not in _SHORTCUT_DTYPES:
            raise ValueError(f"Residual: dtype must be int8 or uint8, got {self.dtype!r}")
        if self.shortcut.out_dtype != "int32" or self.shortcut.bias is not None:
            raise ValueError("Residual: the shortcut requantize must be int32, without a bias")

    @property
    def saturates(self) -> bool:
        """Whether the shortcut's int32 saturation can act: False when (float rounding) every
        ``dtype`` value lands well inside the int32 range, a bound from the requantize's
        constants (then the kernel skips that float64 clip, which never changes a value).

        >>> e = Epilogue(None, (np.float32(0.05), 3, np.float32(1e-4), 0), "float", "int32", 1)
        >>> Residual(e, "int8").saturates
        False
        """
        e = self.shortcut
        if e.rounding != "float":
            return True
        s_in, z_in, s_out, z_out = (np.abs(np.asarray(v, np.float64)) for v in e.params)
        if not (np.all(np.isfinite(s_in)) and np.all(np.isfinite(s_out)) and np.all(s_out > 0)):
            return True
        lo, hi = P.qrange(self.dtype)
        span = max(abs(lo), abs(hi)) + z_in.max()
        bound = span * s_in.max() / s_out.min() * 1.01 + z_out.max() + 1
        return not bound < 2**30


@dataclass(frozen=True, eq=False)
class ResidualChain:
    """A residual chain's pieces: the conv's int32 variable, the bias add's (or None), the
    shortcut requantize's, the residual add's, and the shortcut tensor (an int8 variable)."""

    kernel: relax.Var
    bias_add: relax.Var | None
    shortcut_requantize: relax.Var
    residual_add: relax.Var
    shortcut: relax.Var

    @property
    def parts(self) -> tuple:
        """The intermediate variables the fused kernel call replaces."""
        parts = (self.kernel, self.bias_add, self.shortcut_requantize, self.residual_add)
        return tuple(v for v in parts if v is not None)


def _accumulator(acc, value_of: dict, uses) -> tuple | None:
    """(conv variable, bias add variable or None) of ``acc``: a ``qnn.conv2d`` or
    ``add(qnn.conv2d, constant)``, each used once."""
    e = value_of.get(acc)
    if is_call(e, "qnn.conv2d"):
        return acc, None
    if not is_call(e, "relax.add"):
        return None
    conv = next((a for a in e.args if isinstance(a, relax.Var)), None)
    if conv is None or any(isinstance(a, relax.Var) for a in e.args if not a.same_as(conv)):
        return None
    if not is_call(value_of.get(conv), "qnn.conv2d") or uses[conv] != 1:
        return None
    return conv, acc


def residual_chain(src, value_of: dict, uses) -> ResidualChain | None:
    """The residual chain whose sum ``src`` (the int32 input of the final requantize) is,
    or None: ``add(acc, requantize(shortcut) -> int32)`` (either order), every intermediate
    used once, the shortcut an int8/uint8 variable shaped like the conv's output."""
    add = value_of.get(src)
    if not is_call(add, "relax.add") or uses[src] != 1:
        return None
    if not all(isinstance(a, relax.Var) for a in add.args):
        return None
    for acc, r in (add.args, add.args[::-1]):
        req = value_of.get(r)
        if not is_call(req, "qnn.requantize") or uses[r] != 1 or uses[acc] != 1:
            continue
        short = req.args[0]
        if str(req.attrs["out_dtype"]) != "int32" or not isinstance(short, relax.Var):
            continue
        if dtype_of(short) not in _SHORTCUT_DTYPES or shape_of(short) != shape_of(acc):
            continue
        found = _accumulator(acc, value_of, uses)
        if found is not None:
            return ResidualChain(found[0], found[1], r, src, short)
    return None


def shortcut_load(residual: Residual, buf, n, ch, pixel: tuple):
    """The shortcut's value (int8/uint8, or int16 from a blocked layout) of channel ``ch`` at
    ``pixel`` (its spatial indices) of ``buf`` (a TE tensor or a TIR buffer, NCHW or in the
    residual's layout, whose stored value is ``value + layout.shift``)."""
    lay = residual.layout
    if lay is None:
        return buf[(n, ch, *pixel)]
    stored = buf[(n, ch // lay.block, *pixel, ch % lay.block)].astype("int16")
    return stored - te.const(lay.shift, "int16")


def shortcut_term(residual: Residual, q, ch, table):
    """The int32 term of the shortcut value ``q`` in channel ``ch`` (``table``: the
    residual's table, ``residual.shortcut.table()``, as a tensor or buffer)."""
    return residual.shortcut.value(q, ch, lambda r, k: table[r, k], residual.saturates)


def add_shortcut(value, residual: Residual, dims, inputs: list):
    """``value(n, channel, y, x)`` (the int32 accumulator) plus the residual's shortcut
    term; the shortcut tensor and the shortcut's table are appended to ``inputs``
    (``dims``: the NCHW output shape)."""
    lay = residual.layout
    shape = dims if lay is None else lay.shape(*dims)
    dtype = residual.dtype if lay is None else lay.dtype
    x = te.placeholder(i64(*shape), dtype, name="shortcut")
    table = te.placeholder(residual.shortcut.table().shape, "int32", name="residual")
    inputs += [x, table]

    def f(n, ch, y, x_):
        q = shortcut_load(residual, x, n, ch, (y, x_))
        return value(n, ch, y, x_) + shortcut_term(residual, q, ch, table)

    return f
