"""A nearest-neighbour resize between a dequantize and a quantize runs on the codes.

A feature pyramid's upsampling (PP-OCRv4 det's neck) is realized as

    qnn.quantize(image.resize2d(qnn.dequantize(q, s1, z1), nearest), s2, z2)

Nearest-neighbour resizing only copies values, so it commutes with the per-value map
``f(k) = quantize(dequantize(k))``: the result is ``resize2d(f(q))``. :func:`resize_codes`
writes it so, ``f`` as a ``qnn.lut`` of the 256 codes (its table the numpy primitives', the
legalization's float32 operations one by one), on the low-resolution input: a 2x upsampling
maps a quarter of the values, the 8x of the pyramid's top 1/64, and the resize (an int8
gather) fuses into the op that reads it (the level's add, the concat).

>>> import numpy as np
>>> from autoq import primitives as P
>>> q = np.array([[-5, 7], [100, -128]], dtype=np.int8)
>>> def f(v):
...     return P.quantize(P.dequantize(v, 0.3, 2), 0.7, -1)
>>> up = lambda a: a.repeat(2, 0).repeat(2, 1)
>>> bool((up(f(q)) == f(up(q))).all())
True
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from autoq import primitives as P
from autoq import qnn
from autoq.ir import toolkit as tk

__all__ = ["code_table", "resize_codes"]

CODES = ("int8", "uint8")


def code_table(s1, z1, s2, z2, in_dtype: str, out_dtype: str) -> np.ndarray:
    """``quantize(dequantize(k, s1, z1), s2, z2)`` for the 256 codes ``k`` of ``in_dtype``
    (:func:`autoq.primitives.requantize` in float rounding).

    >>> code_table(0.5, 0, 1.0, 0, "int8", "int8")[[0, 127, 128, 129, 255]].tolist()
    [-64, 0, 0, 0, 64]
    """
    return P.requantize(P.all_codes(in_dtype), s1, z1, s2, z2, out_dtype, rounding="float")


def _scalar(e):
    v = tk.const_array(e)
    return v.reshape(()).item() if v is not None and v.size == 1 else None


def _nearest(call) -> bool:
    a = call.attrs
    return (
        str(a.method) == "nearest_neighbor"
        and str(a.layout) == "NCHW"
        and str(a.coordinate_transformation_mode) != "tf_crop_and_resize"
        and str(a.out_dtype) in ("", "None", "void", "float32")
    )


def _on_codes(value, once, lookup) -> relax.Expr | None:
    """``resize2d(qnn.lut(q, f))`` for ``value`` = ``qnn.quantize(resize2d(qnn.dequantize(q)))``
    (per tensor, 8-bit codes, the resize's float output read by the quantize alone); else
    None."""
    if not tk.is_call(value, "qnn.quantize") or str(value.attrs["out_dtype"]) not in CODES:
        return None
    resize = once(value.args[0])
    if not tk.is_call(resize, "relax.image.resize2d") or not _nearest(resize):
        return None
    deq = lookup(resize.args[0])
    if not tk.is_call(deq, "qnn.dequantize") or tk.dtype_of(deq.args[0]) not in CODES:
        return None
    params = [_scalar(p) for p in (*deq.args[1:], *value.args[1:])]
    if any(p is None for p in params):
        return None
    q = deq.args[0]
    table = code_table(*params, tk.dtype_of(q), str(value.attrs["out_dtype"]))
    codes = qnn.lut(q, relax.const(table))
    return tvm.ir.Call(resize.op, [codes, *resize.args[1:]], resize.attrs)


def resize_codes(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every quantized nearest resize of :func:`_on_codes` in ``main`` on the
    codes (the same values)."""
    return tk.rewrite_main(mod, _on_codes)
