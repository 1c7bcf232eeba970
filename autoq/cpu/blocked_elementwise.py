"""Elementwise int8 ops on tensors in the blocked layout of :mod:`autoq.cpu.blocked`.

A plain int8 ``qnn.add`` / ``qnn.subtract`` / ``qnn.multiply`` (per-tensor, as they all are)
or a per-tensor ``qnn.requantize`` to int8/uint8 does the same thing to every element, so it
can run on blocked operands as well as on NCHW ones: ResNet-50 (open_nsfw) writes the
residual add of its downsampling blocks as ``qnn.add``\\ s of two requantized conv outputs
and a per-channel constant, PP-OCR det its upsampling adds as ``qnn.add``. When such an op's
activation operands all flow blocked (:func:`autoq.cpu.blocked.blocked_edges` decides, with
:func:`blocked_operands`), :func:`blocked_call` emits it on them: each operand back to its
values (``stored - shift``, in its own dtype: an int8 op sees the bytes it always saw), a
constant operand re-blocked, the op itself on the 5-D tensors (its legalization is
shape-agnostic), and the result stored in the consumers' layout. The relax elementwise ops
around it fuse with it into one function; the padded channels hold whatever the op makes of
the padding (the consumers' zero weights ignore them, a residual epilogue never reads them).
"""

from __future__ import annotations

import numpy as np
from tvm import relax

from autoq.cpu.blocked import BlockedLayout
from autoq.ir.toolkit import const_array, dtype_of, is_call, shape_of

__all__ = ["blocked_call", "blocked_operands", "reblock_constant"]

_BINARY = ("qnn.add", "qnn.subtract", "qnn.multiply")
_DTYPES = ("int8", "uint8")


def _scalars(args) -> bool:
    return all((v := const_array(a)) is not None and v.size == 1 for a in args)


def blocked_operands(call) -> tuple[int, ...] | None:
    """The positions of the activation operands of ``call`` when it is an elementwise int8
    op that can run on blocked tensors (``qnn.add`` / ``subtract`` / ``multiply``, or a
    ``qnn.requantize`` with scalar operands; int8/uint8 in and out, a static 4-D output, each
    activation operand a variable of the output's shape, any other data operand a
    constant that broadcasts to it), else None."""
    if is_call(call, *_BINARY):
        data, params = (0, 1), call.args[2:]
    elif is_call(call, "qnn.requantize"):
        data, params = (0,), call.args[1:]
    else:
        return None
    shape = shape_of(call)
    if str(call.attrs["out_dtype"]) not in _DTYPES or shape is None or len(shape) != 4:
        return None
    if not _scalars(params):
        return None
    found = []
    for i in data:
        a = call.args[i]
        if dtype_of(a) not in _DTYPES:
            return None
        if isinstance(a, relax.Var):
            if shape_of(a) != shape:
                return None
            found.append(i)
        elif (v := const_array(a)) is None or not _broadcasts(v.shape, shape):
            return None
    return tuple(found) or None


def _broadcasts(have, shape) -> bool:
    if len(have) > len(shape):
        return False
    full = (1,) * (len(shape) - len(have)) + tuple(have)
    return all(d in (1, s) for d, s in zip(full, shape, strict=True))


def reblock_constant(v: np.ndarray, block: int) -> np.ndarray:
    """A constant that broadcasts against an NCHW tensor, as one that broadcasts against its
    blocked form ``[N, C/block, H, W, block]`` (channels padded with zeros).

    >>> reblock_constant(np.arange(20).reshape(1, 20, 1, 1), 16).shape
    (1, 2, 1, 1, 16)
    >>> reblock_constant(np.int8(3), 16).shape
    (1, 1, 1, 1, 1)
    """
    v = np.asarray(v).reshape((1,) * (4 - np.ndim(v)) + np.shape(v))
    n, c, h, w = v.shape
    if c == 1:
        return v.reshape(n, 1, h, w, 1)
    cp = -(-c // block) * block
    padded = np.zeros((n, cp, h, w), v.dtype)
    padded[:, :c] = v
    return np.ascontiguousarray(
        padded.reshape(n, cp // block, block, h, w).transpose(0, 1, 3, 4, 2)
    )


def _values(bb, stored, layout: BlockedLayout, dtype: str):
    """The ``dtype`` values of a blocked tensor (``stored - shift``)."""
    wide = bb.emit(relax.op.astype(stored, "int16"))
    v = bb.emit(relax.op.subtract(wide, relax.const(np.int16(layout.shift))))
    return bb.emit(relax.op.astype(v, dtype))


def _store(bb, value, layout: BlockedLayout):
    """``value`` (int8/uint8, 5-D) stored in ``layout`` (``value + shift``)."""
    wide = bb.emit(relax.op.astype(value, "int16"))
    v = bb.emit(relax.op.add(wide, relax.const(np.int16(layout.shift))))
    return relax.op.astype(v, layout.dtype)


def blocked_call(bb, call, fed: dict, layout: BlockedLayout):
    """``call`` (:func:`blocked_operands` not None) on its blocked operands (``fed``:
    ``{operand variable: (blocked variable, its layout)}``), stored in ``layout``."""
    args = list(call.args)
    for i in blocked_operands(call):
        stored, lay = fed[args[i]]
        args[i] = _values(bb, stored, lay, dtype_of(args[i]))
    if is_call(call, *_BINARY):
        for i in (0, 1):
            if not isinstance(args[i], relax.Var):
                v = const_array(args[i])
                args[i] = relax.const(reblock_constant(v, layout.block).astype(v.dtype))
    out = bb.emit(relax.Call(call.op, args, call.attrs))
    return _store(bb, out, layout)
