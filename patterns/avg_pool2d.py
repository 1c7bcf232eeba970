"""Pattern ``avg_pool2d``: a windowed average pool as an accumulating layer (like ``mean``).

Every window of an NCHW ``nn.avg_pool2d`` averages the same number of values ``N = kh * kw``
when no window reads padding that is left out of the count (``count_include_pad``, or no
padding) and ``ceil_mode`` adds no partial window. Then the pool is a window *sum* of the
centered integers followed by a scale ``s_x / N``; the window sum is a depthwise
convolution with an all-ones kernel, which every int8 engine runs (padding pads the real
value 0, i.e. the zero point, exactly what ``count_include_pad`` averages in).

Simulated::  acc = conv2d(q - zp, ones[C, 1, kh, kw], groups=C)  (integer-valued float32)
             out = simulated_dequantize(acc, s / N, 0)
Realized::   acc = qnn.conv2d(q, ones int8 [C, 1, kh, kw], s, zp, 1.0, 0, groups=C)  (int32)
             out = qnn.dequantize(acc, s / N, 0)    (a qnn.requantize after propagation)

Pools with a varying count (``count_include_pad=False`` with padding, partial ``ceil_mode``
windows) are rejected and stay fp32 between ``qnn.dequantize`` and ``qnn.quantize``.
``autoq.byoc`` names the realized form ``avg_pool2d_requantize`` (the all-ones kernel with
weight scale 1 tells it from a convolution).

``rounding="tflite"``/``"tflite_single"`` (unpadded pools): TFLite's AVERAGE_POOL_2D, the
raw integers summed and the sum divided by N rounded half away from zero, on the input's
grid (:mod:`autoq.qnn.tflite_arith`)::

    acc = qnn.conv2d(q, ones, s, 0, 1.0, 0)        (int32: sum of the raw q)
    avg = qnn.requantize(acc, s / N, 0, s, 0, rounding="half_away", multiplier, shift)
    out = qnn.dequantize(avg, s, zp)               (dropped when the consumer's grid is the same)
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.ir.registry import Pattern, register
from autoq.ir.toolkit import const, shape_of
from autoq.qnn import tflite_arith as TA

from ._accumulate import is_activation


def _window(call, in_shape, out_shape) -> tuple[int, int] | None:
    """(kh, kw) when every output averages kh * kw values, else None."""
    a = call.attrs
    if a.layout != "NCHW" or a.out_layout != "NCHW" or in_shape is None or out_shape is None:
        return None
    kh, kw = (int(v) for v in a.pool_size)
    pad = [int(v) for v in a.padding]
    if any(pad) and not bool(a.count_include_pad):
        return None
    if bool(a.ceil_mode):
        sh, sw = (int(v) for v in a.strides)
        dh, dw = (int(v) for v in a.dilation)
        for axis, k, s, d, lo, hi in (
            (2, kh, sh, dh, pad[0], pad[2]),
            (3, kw, sw, dw, pad[1], pad[3]),
        ):
            if (out_shape[axis] - 1) * s + d * (k - 1) + 1 > in_shape[axis] + lo + hi:
                return None
    return kh, kw


def _conv_attrs(call) -> dict:
    a = call.attrs
    return {
        "strides": [int(v) for v in a.strides],
        "padding": [int(v) for v in a.padding],
        "dilation": [int(v) for v in a.dilation],
    }


def _ones(channels: int, kh: int, kw: int, dtype: str) -> np.ndarray:
    return np.ones((channels, 1, kh, kw), dtype)


def build():
    x = wildcard()
    return is_op("relax.nn.avg_pool2d")(x), {"data": x}


def check(g, nodes):
    if not is_activation(g, nodes["data"]):
        return "input is not a float32 activation"
    call = g.value[nodes["root"]]
    if _window(call, shape_of(nodes["data"]), shape_of(nodes["root"])) is None:
        return "windows average different counts (padding left out, or a partial ceil_mode window)"
    return None


def _frame(ctx, m):
    call = ctx.g.value[m.root]
    kh, kw = _window(call, shape_of(m["data"]), shape_of(m.root))
    return call, shape_of(m["data"])[1], kh, kw


def simulate(ctx, m):
    call, c, kh, kw = _frame(ctx, m)
    x = ctx.activation(m["data"])
    ones = relax.const(_ones(c, kh, kw, "float32"))
    acc = ctx.emit(relax.op.nn.conv2d(x.centered, ones, groups=c, **_conv_attrs(call)))
    scale = ctx.emit(relax.op.divide(x.scale, relax.const(np.float32(kh * kw))))
    return qnn.simulated_dequantize(acc, scale, relax.const(np.int32(0)))


def realize(ctx, m):
    call, c, kh, kw = _frame(ctx, m)
    x = ctx.activation(m["data"])
    # TFLite sums the raw integers (zero point 0: the average on a shifted real axis; a
    # padded pool keeps the canonical form, its padding must be the real value 0)
    tflite = ctx.rounding in TA.TFLITE_MODES and not any(_conv_attrs(call)["padding"])
    zp = const(0, "int32") if tflite else x.zero_point_c
    acc = qnn.conv2d(
        x.q, const(_ones(c, kh, kw, x.dtype)), x.scale_c, zp,
        const(1.0, "float32"), const(0, "int32"), groups=c, **_conv_attrs(call),
    )  # fmt: skip
    acc = ctx.emit(acc)
    scale = const(np.float32(x.scale) / np.float32(kh * kw), "float32")
    if tflite:
        avg = ctx.emit(_tflite_average(acc, x, scale, kh * kw))
        return qnn.dequantize(avg, x.scale_c, x.zero_point_c)
    return qnn.dequantize(acc, scale, const(0, "int32"))


def _tflite_average(acc, x, scale, count: int):
    """TFLite's AVERAGE_POOL_2D: the raw window sum divided by the count, rounded half away
    from zero, on the input's grid (``half_away`` requantize with zero points 0 and the
    multiplier of :func:`autoq.qnn.tflite_arith.average_multiplier`: the same integers)."""
    m, shift = TA.average_multiplier(count)
    zero = const(0, "int32")
    return qnn.requantize(
        acc, scale, zero, x.scale_c, zero, out_dtype=x.dtype, rounding="half_away",
        multiplier=const(m, "int32"), shift=const(shift, "int32"),
    )  # fmt: skip


PATTERN = register(
    Pattern(
        "avg_pool2d",
        1,
        build,
        check,
        simulate,
        realize,
        weight=None,
        anchor="root",
        doc="windowed average pool: an integer window sum (depthwise all-ones conv), scale / N",
    )
)
