"""Lower ``qnn.conv2d`` / ``qnn.dense`` / ``qnn.matmul`` with constant weights to autoq's
packed CPU kernels (a target-chosen lowering; the canonical ``qnn.*`` graph is unchanged).

:func:`lower_to_cpu_kernels` legalizes the module with these ops mapped to ``call_tir`` of
the scheduled PrimFuncs of :mod:`autoq.cpu.conv2d` / :mod:`autoq.cpu.dense`, their weights
packed into constants once (depthwise conv: :mod:`autoq.cpu.depthwise`); every call the
kernels do not cover (grouped conv other than depthwise, non-constant or asymmetric weights,
per-axis activation zero points, run-time ones other than a dense layer's, dynamic shapes,
uint8 weights) keeps the op's own legalization. A ``qnn.dense`` with a run-time activation
zero point (the dynamic layers, per token or per tensor) runs the kernel on the raw codes
and subtracts ``z_x * sum(w)`` after it (sibling layers reading one quantized input share one
kernel call, :mod:`autoq.cpu.sibling_dense`); per-token ``qnn.dynamic_quantize`` becomes
:mod:`autoq.cpu.dynamic_quantize`. float32 softmax becomes
:mod:`autoq.cpu.softmax` (parallel, denormal probabilities flushed to 0; a softmax of a
per-tensor dequantize reads the codes, and writes those of a quantize that alone reads it:
:mod:`autoq.cpu.softmax_dequantize`), float32 layer norm
over the last axis :mod:`autoq.cpu.layer_norm` (the same floats); int8 / uint8
NCHW max pools :mod:`autoq.cpu.max_pool` (rows, then columns: vectorized); a
``qnn.matmul`` of two activations (int8 rhs, same batch axes) :mod:`autoq.cpu.batch_matmul`.
On targets with AMX int8 tiles, dense (>= ``AMX_MIN_ROWS`` rows), the convs
:func:`autoq.cpu.amx_conv2d.amx_conv_applies` accepts and the matmuls of two activations
:func:`autoq.cpu.amx_batch_matmul.amx_batch_matmul_applies` accepts run on
:mod:`autoq.cpu.amx_dense` / :mod:`autoq.cpu.amx_conv2d` / :mod:`autoq.cpu.amx_batch_matmul`
instead (strided convs with at most 4 input channels, an image's stem:
:mod:`autoq.cpu.amx_strided_conv2d`), and the float requantizes of 8-bit codes outside the kernels (adds / subtracts of
two 8-bit tensors, 8-bit requantizes) divide by a reciprocal
(:mod:`autoq.cpu.reciprocal_elementwise`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
import tvm
from tvm import relax

from autoq import primitives as P
from autoq.cpu.amx_batch_matmul import amx_batch_matmul_applies, amx_batch_matmul_kernel
from autoq.cpu.amx_conv2d import (
    amx_conv2d_kernel,
    amx_conv_applies,
    amx_conv_compensation,
    amx_conv_weight,
    amx_shortcut_shape,
)
from autoq.cpu.amx_dense import amx_dense_kernel
from autoq.cpu.amx_strided_conv2d import (
    amx_strided_conv2d_kernel,
    amx_strided_conv_applies,
    strided_conv_weight,
)
from autoq.cpu.amx_tiles import BLOCK as AMX_BLOCK
from autoq.cpu.amx_tiles import KSTEP as AMX_KSTEP
from autoq.cpu.batch_matmul import batch_matmul_kernel, matmul_zero_points
from autoq.cpu.blocked import BlockedLayout, layout_for, lut_layout
from autoq.cpu.conv2d import ConvShape, conv2d_kernel
from autoq.cpu.conv_transpose import conv2d_transpose_kernel
from autoq.cpu.dense import dense_kernel
from autoq.cpu.depthwise import depthwise_kernel, depthwise_weight, zero_point_input
from autoq.cpu.dynamic_quantize import dynamic_quantize_kernel
from autoq.cpu.epilogue import Epilogue
from autoq.cpu.fuse_epilogue import fuse_epilogues
from autoq.cpu.gate_tables import gate_tables
from autoq.cpu.isa import VNNI, Isa, IsaChoice, isa_choice
from autoq.cpu.layer_norm import layer_norm_kernel
from autoq.cpu.lut import (
    VBMI_TABLE_DTYPES,
    channel_lut_kernel,
    current_target_has,
    lut_kernel,
    target_has_vbmi,
    vbmi_channel_lut_kernel,
    vbmi_lut_kernel,
)
from autoq.cpu.max_pool import DTYPES as POOL_DTYPES
from autoq.cpu.max_pool import max_pool2d_kernel
from autoq.cpu.packing import compensation, pack_conv_weight, pack_dense_weight, round_up
from autoq.cpu.pool_requantize import requantize_after_pools
from autoq.cpu.reciprocal_elementwise import reciprocal_elementwise, reciprocal_requantize
from autoq.cpu.resize_codes import resize_codes
from autoq.cpu.sibling_dense import merge_sibling_dense, minus_zero_point
from autoq.cpu.softmax import inner_axis_covered, quantizes, softmax_kernel, softmax_table
from autoq.cpu.softmax_dequantize import fold_dequantize_into_softmax
from autoq.ir.toolkit import const_array, dtype_of, is_call, shape_of
from autoq.qnn.accumulate import depthwise_shape
from autoq.qnn.dynamic_quantize import qparam_range

__all__ = ["lower_to_cpu_kernels"]

_ACT_DTYPES = ("int8", "uint8")
# dense rows from which AMX tiles beat the VNNI kernel (measured, 1 thread, K 384..1536:
# 4 rows 0.6x, 8 rows 1.1x, 16 rows 1.7x, 128 rows 5-10x)
AMX_MIN_ROWS = 8
# conv kernels that add a residual in their epilogue (autoq.cpu.residual)
_RESIDUAL_KINDS = ("packed", "amx")
# conv kernels on AMX tiles (NCHW in and out)
_AMX_KINDS = ("amx", "amx_strided")


def _scalar(expr) -> int | None:
    v = const_array(expr)
    if v is None or v.size != 1:
        return None
    return int(v.reshape(-1)[0])


def _zero(expr) -> bool:
    v = const_array(expr)
    return v is not None and not np.any(v)


def _input_zero_point(z_x) -> int | np.ndarray | None:
    """The activation zero point: an int, a ``[C]`` int32 array of distinct per-channel ones
    (a depthwise input, :mod:`autoq.rules.depthwise_channels`), or None (not a constant)."""
    v = const_array(z_x)
    if v is None or v.ndim > 1:
        return None
    if v.size == 1 or np.all(v == v.reshape(-1)[0]):
        return int(v.reshape(-1)[0])
    return v.astype(np.int32)


def _operands(data, weight, z_x, z_w):
    """(data dtype, activation zero point, weight array) when the kernels apply, else None."""
    w = const_array(weight)
    zx = _input_zero_point(z_x)
    dt = dtype_of(data)
    if w is None or zx is None or not _zero(z_w) or dt not in _ACT_DTYPES:
        return None
    if w.dtype != np.int8 or shape_of(data) is None:
        return None
    return dt, zx, w


def _out_type(shape, epilogue: Epilogue | None) -> relax.TensorType:
    return relax.TensorType(shape, "int32" if epilogue is None else epilogue.out_dtype)


def _tail(args: list, epilogue: Epilogue | None) -> list:
    """``args`` plus the epilogue's table constant."""
    if epilogue is not None:
        return [*args, relax.const(epilogue.table())]
    return args


def _call(bb, isa: Isa, func, name: str, data, w_packed, w, z: int, out_ty, epilogue=None,
          extra=()):  # fmt: skip
    """``call_tir`` of ``func`` (added to the module) on data + packed constants (+ ``extra``
    arguments); ``out_ty`` its output type (or output shape, the dtype from ``epilogue``)."""
    gv = bb.add_func(func.without_attr("global_symbol"), name)
    args = [data, relax.const(w_packed)]
    if z:
        args.append(relax.const(compensation(w, z, isa.padded_channels(w.shape[0]))))
    args += extra
    if not isinstance(out_ty, relax.TensorType):
        out_ty = _out_type(out_ty, epilogue)
    return relax.call_tir(gv, _tail(args, epilogue), out_ty=out_ty)


def _conv_plan(choice: IsaChoice, call):
    """(data dtype, zero point, weights, ConvShape, kind) of a ``qnn.conv2d`` the kernels
    cover (kind: "depthwise", "amx", "amx_strided" or "packed"; the convs ``choice`` keeps on
    VNNI are on neither AMX kernel), or None."""
    data, weight, _s_x, z_x, _s_w, z_w = call.args
    ops = _operands(data, weight, z_x, z_w)
    a = call.attrs
    groups = int(a["groups"])
    if ops is None:
        return None
    dt, zx, w = ops
    n, c, h, wd = shape_of(data)
    depthwise = depthwise_shape(c, w.shape, groups)
    if (groups != 1 and not depthwise) or (np.ndim(zx) != 0 and not depthwise):
        return None
    shape = ConvShape(
        n, c, h, wd, w.shape[0], tuple(w.shape[2:]),
        tuple(int(v) for v in a["strides"]),
        tuple(int(v) for v in a["padding"]),
        tuple(int(v) for v in a["dilation"]),
    )  # fmt: skip
    amx = not depthwise and choice.isa.amx and not choice.keeps_on_vnni(weight)
    if depthwise:
        kind = "depthwise"
    elif amx and amx_conv_applies(shape):
        kind = "amx"
    elif amx and shape.strides != (1, 1) and amx_strided_conv_applies(shape):
        kind = "amx_strided"
    else:
        kind = "packed"
    return dt, zx, w, shape, kind


def _layout_of(choice: IsaChoice, call) -> BlockedLayout | None:
    """The blocked layout the packed conv kernel reads ``call``'s data in, or None (not a
    conv, or one another kernel runs)."""
    if not is_call(call, "qnn.conv2d"):
        return None
    plan = _conv_plan(choice, call)
    if plan is None or plan[4] in _AMX_KINDS:
        return None
    if np.ndim(plan[1]) != 0:  # per-channel (depthwise): the layout of zero point 0, the
        return layout_for(choice.isa, plan[0], 0)  # kernel centers each channel (cpu.depthwise)
    return layout_for(choice.isa, plan[0], plan[1])


def _takes_residual(choice: IsaChoice, call) -> bool:
    """Whether the kernel of ``call`` (a ``qnn.conv2d``) adds a residual in its epilogue
    (:mod:`autoq.cpu.residual`: the packed and the AMX conv kernels)."""
    plan = _conv_plan(choice, call)
    return plan is not None and plan[4] in _RESIDUAL_KINDS


def _conv2d_call(
    choice: IsaChoice, bb, call, epilogue: Epilogue | None = None, fed=None, out_layout=None,
    residual=None,
):  # fmt: skip
    """The kernel call of a ``qnn.conv2d`` (with ``epilogue``; ``fed``: its data as a blocked
    (variable, layout); ``out_layout``: store the output blocked; ``residual``: (Residual,
    shortcut expression) added before the epilogue), or None when no kernel covers it."""
    isa, plan = choice.isa, _conv_plan(choice, call)
    if plan is None or (residual is not None and plan[4] not in _RESIDUAL_KINDS):
        return None
    dt, zx, w, shape, kind = plan
    data, in_layout = (call.args[0], None) if fed is None else fed
    out = (shape.batch, w.shape[0], *shape.out_hw)
    res, extra = (None, ()) if residual is None else (residual[0], residual[1:])
    if res is not None:
        extra = (*extra, relax.const(res.shortcut.table()))
    ty = _out_type(out, epilogue)
    if out_layout is not None:
        ty = relax.TensorType(out_layout.shape(*out), out_layout.dtype)
    if kind == "depthwise":
        func = depthwise_kernel(shape, dt, zx, isa.lanes, epilogue, in_layout, out_layout)
        name = "autoq_depthwise" + ("_blocked" if in_layout or out_layout else "")
        gv = bb.add_func(func.without_attr("global_symbol"), name)
        args = [data, relax.const(depthwise_weight(shape, w, isa.lanes, in_layout, out_layout))]
        zps = zero_point_input(zx, shape, isa.lanes, in_layout, out_layout)
        args = _tail(args if zps is None else [*args, relax.const(zps)], epilogue)
        return relax.call_tir(gv, args, out_ty=ty)
    if kind == "amx":
        return _amx_conv2d(bb, shape, data, w, dt, zx, out, epilogue, res, extra)
    if kind == "amx_strided":
        return _amx_strided_conv2d(bb, shape, data, w, dt, zx, out, epilogue)
    func = conv2d_kernel(shape, isa, dt, zx, epilogue, in_layout, out_layout, res)
    packed = pack_conv_weight(
        w,
        isa.lanes,
        isa.k,
        shape.ic_block(isa, in_layout is not None),
        isa.weight_dtype,
        isa.padded_channels(w.shape[0]),
    )
    z = zx + isa.shift(dt, zx)
    name = f"autoq_conv2d_{isa.name}" + ("_blocked" if in_layout or out_layout else "")
    name += "_residual" if res is not None else ""
    return _call(bb, isa, func, name, data, packed, w, z, ty, epilogue, extra)


def _conv2d(choice: IsaChoice, fallback, bb, call):
    out = _conv2d_call(choice, bb, call)
    return fallback(bb, call) if out is None else out


def _amx_dense(bb, x2, w: np.ndarray, dt: str, zx: int, m: int, epilogue=None):
    """``call_tir`` of :mod:`autoq.cpu.amx_dense` (VNNI packing, N padded to 32, K to 64)."""
    (n, k), shift = w.shape, VNNI.shift(dt, zx)
    func = amx_dense_kernel(m, k, n, dt, shift, epilogue)
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_dense_amx")
    np_ = round_up(n, AMX_BLOCK)
    packed = pack_dense_weight(w, VNNI.lanes, VNNI.k, "int8", np_, round_up(k, AMX_KSTEP))
    comp = compensation(w, zx + shift, np_)
    args = _tail([x2, relax.const(packed), relax.const(comp)], epilogue)
    return relax.call_tir(gv, args, out_ty=_out_type((m, n), epilogue))


def _amx_conv2d(bb, shape: ConvShape, data, w: np.ndarray, dt: str, zx: int, out, epilogue=None,
                residual=None, extra=()):  # fmt: skip
    """``call_tir`` of :mod:`autoq.cpu.amx_conv2d` (stride-1 conv as channels x pixels; with
    a ``residual``, ``extra`` = its shortcut and table)."""
    shift = VNNI.shift(dt, zx)
    func = amx_conv2d_kernel(shape, dt, shift, zx + shift, epilogue, residual)
    name = "autoq_conv2d_amx" + ("_residual" if residual is not None else "")
    if residual is not None:  # the shortcut with its pixels flattened (a view)
        flat, _ = amx_shortcut_shape(residual, *out)
        extra = (bb.emit(relax.op.reshape(extra[0], flat)), *extra[1:])
    gv = bb.add_func(func.without_attr("global_symbol"), name)
    consts = [amx_conv_weight(w), amx_conv_compensation(w, zx + shift)]
    args = _tail([data, *(relax.const(v) for v in consts), *extra], epilogue)
    return relax.call_tir(gv, args, out_ty=_out_type(out, epilogue))


def _amx_strided_conv2d(bb, shape: ConvShape, data, w: np.ndarray, dt: str, zx: int, out,
                        epilogue=None):  # fmt: skip
    """``call_tir`` of :mod:`autoq.cpu.amx_strided_conv2d` (few input channels: the taps
    packed im2col-style)."""
    shift = VNNI.shift(dt, zx)
    func = amx_strided_conv2d_kernel(shape, dt, shift, zx + shift, epilogue)
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_conv2d_amx_strided")
    consts = [strided_conv_weight(w), amx_conv_compensation(w, zx + shift)]
    args = _tail([data, *(relax.const(v) for v in consts)], epilogue)
    return relax.call_tir(gv, args, out_ty=_out_type(out, epilogue))


def _dense_call(isa: Isa, bb, data, w: np.ndarray, dt: str, zx: int, epilogue=None):
    shape = shape_of(data)
    m = int(np.prod(shape[:-1], dtype=np.int64))
    x2 = bb.emit(relax.op.reshape(data, [m, shape[-1]])) if len(shape) != 2 else data
    if isa.amx and m >= AMX_MIN_ROWS:
        out = _amx_dense(bb, x2, w, dt, zx, m, epilogue)
    else:
        func = dense_kernel(m, shape[-1], w.shape[0], isa, dt, zx, epilogue)
        packed = pack_dense_weight(
            w, isa.lanes, isa.k, isa.weight_dtype, isa.padded_channels(w.shape[0])
        )
        z = zx + isa.shift(dt, zx)
        name = f"autoq_dense_{isa.name}"
        out = _call(bb, isa, func, name, x2, packed, w, z, (m, w.shape[0]), epilogue)
    if len(shape) == 2:
        return out
    return relax.op.reshape(bb.emit(out), [*shape[:-1], w.shape[0]])


def _dense_operands(call):
    """(data, weight [N, K], data dtype, zero point) of a qnn.dense / qnn.matmul with
    constant weights the kernels cover, or None."""
    a, b, _s_a, z_a, _s_b, z_b = call.args
    ops = _operands(a, b, z_a, z_b)
    if ops is None:
        return None
    dt, za, w = ops
    if np.ndim(za) != 0:  # (per-channel zero points: depthwise convs only)
        return None
    if is_call(call, "qnn.matmul"):
        if w.ndim != 2:
            return None
        w = np.ascontiguousarray(w.T)
    return a, w, dt, za


def _runtime_zero_point_operands(call):
    """(data, weight [N, K], data dtype, zero point expression) of a ``qnn.dense`` whose
    activation zero point is a run-time tensor (``qnn.dynamic_quantize``: a scalar or one per
    row) and whose weight the kernels cover, or None."""
    data, weight, _s_x, z_x, _s_w, z_w = call.args
    if const_array(z_x) is not None:
        return None
    ops = _operands(data, weight, relax.const(0, "int32"), z_w)
    return None if ops is None else (data, ops[2], ops[0], z_x)


def _raw_dense(isa: Isa, bb, data, w: np.ndarray, dt: str):
    """The kernel's int32 ``x @ w.T`` on the raw codes (no zero point)."""
    return _dense_call(isa, bb, data, w, dt, 0)


def _runtime_zero_point_dense(isa: Isa, bb, data, w: np.ndarray, dt: str, z_x):
    """``(x - z_x) @ w.T`` for a run-time ``z_x``: the kernel's ``x @ w.T`` minus
    ``z_x * sum_k(w)`` (:func:`autoq.cpu.sibling_dense.minus_zero_point`)."""
    return minus_zero_point(bb.emit(_raw_dense(isa, bb, data, w, dt)), z_x, w)


def _dense(choice: IsaChoice, fallback, bb, call):
    ops = _dense_operands(call)
    if ops is not None:
        return _dense_call(choice.isa, bb, *ops)
    if is_call(call, "qnn.dense") and (runtime := _runtime_zero_point_operands(call)):
        return _runtime_zero_point_dense(choice.isa, bb, *runtime)
    return fallback(bb, call)


def _by_reciprocal(epilogue: Epilogue, res):
    """``epilogue`` and the residual's shortcut term (``res``: (Residual, shortcut...) or
    None) dividing by their output scale as a reciprocal product with FMA corrections
    (:attr:`autoq.cpu.epilogue.Epilogue.reciprocal`: the same quotients)."""
    epilogue = replace(epilogue, reciprocal=True)
    if res is not None:
        short = replace(res[0].shortcut, reciprocal=True)
        res = (replace(res[0], shortcut=short), *res[1:])
    return epilogue, res


def _with_epilogue(choice: IsaChoice, bb, call, epilogue: Epilogue, fed=None, out_layout=None,
                   res=None):  # fmt: skip
    """The kernel call of ``call`` storing ``epilogue``'s int8 output (blocked, residual:
    see :func:`_conv2d_call`), or None."""
    isa = choice.isa
    if isa.reciprocal and epilogue is not None:  # (None: a bare conv reading a blocked tensor)
        epilogue, res = _by_reciprocal(epilogue, res)
    if is_call(call, "qnn.conv2d"):
        return _conv2d_call(choice, bb, call, epilogue, fed, out_layout, res)
    if res is not None:
        return None
    if is_call(call, "qnn.matmul") and const_array(call.args[1]) is None:
        return _activation_matmul(isa, bb, call, epilogue)
    ops = _dense_operands(call)
    return None if ops is None else _dense_call(isa, bb, *ops, epilogue)


def _activation_matmul(isa: Isa, bb, call, epilogue: Epilogue | None = None):
    """``call_tir`` of :mod:`autoq.cpu.batch_matmul` (:mod:`autoq.cpu.amx_batch_matmul` on
    AMX targets, for the shapes it covers) for a qnn.matmul of two activations with the same
    static batch axes (storing ``epilogue``'s output), or None."""
    a, b, _s_a, z_a, _s_b, z_b = call.args
    za, zb = _scalar(z_a), _scalar(z_b)
    sa, sb = shape_of(a), shape_of(b)
    if za is None or zb is None or sa is None or sb is None or len(sa) < 2:
        return None
    if dtype_of(a) not in _ACT_DTYPES or dtype_of(b) != "int8" or sa[:-2] != sb[:-2]:
        return None
    batch = int(np.prod(sa[:-2], dtype=np.int64))
    (m, k), n = sa[-2:], sb[-1]
    a3 = bb.emit(relax.op.reshape(a, [batch, m, k]))
    b3 = bb.emit(relax.op.reshape(b, [batch, k, n]))
    if isa.amx and amx_batch_matmul_applies(m, k, n):
        func = amx_batch_matmul_kernel(batch, m, k, n, dtype_of(a), epilogue, (za, zb))
        name = "autoq_batch_matmul_amx"
    else:
        func = batch_matmul_kernel(batch, m, k, n, isa, dtype_of(a), epilogue, (za, zb))
        name = f"autoq_batch_matmul_{isa.name}"
    gv = bb.add_func(func.without_attr("global_symbol"), name)
    args = _tail([a3, b3, relax.const(matmul_zero_points(za, zb))], epilogue)
    out = bb.emit(relax.call_tir(gv, args, out_ty=_out_type((batch, m, n), epilogue)))
    return relax.op.reshape(out, [*sa[:-2], m, n])


def _matmul(choice: IsaChoice, fallback, bb, call):
    if const_array(call.args[1]) is None:
        lowered = _activation_matmul(choice.isa, bb, call)
        return fallback(bb, call) if lowered is None else lowered
    return _dense(choice, fallback, bb, call)


def _conv2d_transpose(choice: IsaChoice, fallback, bb, call):
    """float32 conv2d_transpose with kernel == stride (NCHW / IOHW, no padding, dilation,
    output padding or groups) -> the sub-pixel kernel; anything else -> ``fallback``."""
    data, weight = call.args
    a = call.attrs
    x_shape, w_shape = shape_of(data), shape_of(weight)
    plain = (
        x_shape is not None
        and w_shape is not None
        and len(x_shape) == 4
        and dtype_of(data) == dtype_of(weight) == "float32"
        and str(a.out_dtype) in ("", "None", "void", "float32")
        and (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "IOHW", "NCHW")
        and int(a.groups) == 1
        and tuple(int(v) for v in a.strides) == tuple(w_shape[2:])
        and not any(int(v) for v in a.padding)
        and not any(int(v) for v in a.output_padding)
        and all(int(v) == 1 for v in a.dilation)
    )
    if not plain:
        return fallback(bb, call)
    # vector registers for accumulators: 24 of AVX-512's 32 (the VNNI targets), 12 of 16
    func = conv2d_transpose_kernel(
        x_shape, w_shape, accumulators=24 if choice.isa.name == VNNI.name else 12
    )
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_conv2d_transpose")
    out = (x_shape[0], w_shape[1], x_shape[2] * w_shape[2], x_shape[3] * w_shape[3])
    return relax.call_tir(gv, [data, weight], out_ty=relax.TensorType(out, "float32"))


def _softmax(_choice: IsaChoice, fallback, bb, call):
    (data,) = call.args
    shape = shape_of(data)
    axis = int(call.attrs["axis"])
    if shape is None or dtype_of(data) != "float32" or len(shape) < 2:
        return fallback(bb, call)
    last = axis in (-1, len(shape) - 1)
    if not last and not inner_axis_covered(tuple(int(d) for d in shape), axis):
        return fallback(bb, call)
    return _softmax_call(bb, data, tuple(int(d) for d in shape), axis=axis)


def _softmax_call(bb, data, shape: tuple[int, ...], dequantize=None, quantize=None, axis=-1):
    """The call of :func:`autoq.cpu.softmax.softmax_kernel` on ``data`` (float32, or the
    codes of ``dequantize``: :mod:`autoq.cpu.softmax_dequantize`), writing the probabilities
    or their ``quantize`` codes (None where the kernel cannot quantize them exactly)."""
    if quantize is not None and not quantizes(shape[-1], quantize[1]):
        return None
    avx512 = current_target_has("avx512f")
    func = softmax_kernel(shape, axis, avx512, dequantize, quantize).without_attr("global_symbol")
    gv = bb.add_func(func, "autoq_softmax")
    table = relax.const(softmax_table(), "int64")
    dtype = "float32" if quantize is None else quantize[0]
    return relax.call_tir(gv, [data, table], out_ty=relax.TensorType(shape, dtype))


def _layer_norm(_choice: IsaChoice, fallback, bb, call):
    """float32 layer norm over the last axis of a static shape -> the row-parallel kernel of
    :mod:`autoq.cpu.layer_norm` (the generic lowering's floats); anything else -> ``fallback``."""
    data, gamma, beta = call.args
    shape = shape_of(data)
    axes = [int(a) for a in call.attrs["axes"]]
    if shape is None or not shape or 0 in shape or dtype_of(data) != "float32":
        return fallback(bb, call)
    if axes not in ([-1], [len(shape) - 1]):
        return fallback(bb, call)
    if any(dtype_of(p) != "float32" or shape_of(p) != shape[-1:] for p in (gamma, beta)):
        return fallback(bb, call)
    func = layer_norm_kernel(shape, float(call.attrs["epsilon"]))
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_layer_norm")
    return relax.call_tir(gv, [data, gamma, beta], out_ty=relax.TensorType(shape, "float32"))


def _dynamic_quantize(choice: IsaChoice, fallback, bb, call):
    """Per-token ``qnn.dynamic_quantize`` of a static shape -> the row-parallel kernel of
    :mod:`autoq.cpu.dynamic_quantize` on ``[rows, K]``; anything else -> ``fallback``."""
    (data,) = call.args
    shape = shape_of(data)
    a = call.attrs
    if shape is None or not shape or 0 in shape or str(a["granularity"]) != "token":
        return fallback(bb, call)
    rows, k = math.prod(shape[:-1]), shape[-1]
    out_dtype = str(a["out_dtype"])
    func = dynamic_quantize_kernel(
        rows, k, out_dtype, qparam_range(call), bool(a["symmetric"]), choice.isa.reciprocal
    )
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_dynamic_quantize")
    x2 = bb.emit(relax.op.reshape(data, [rows, k])) if len(shape) != 2 else data
    types = [
        relax.TensorType((rows, k), out_dtype),
        relax.TensorType((rows, 1), "float32"),
        relax.TensorType((rows, 1), "int32"),
    ]
    out = bb.emit(relax.call_tir(gv, [x2], out_ty=types))
    qparams = [*shape[:-1], 1]
    shapes = [list(shape), qparams, qparams]
    parts = [relax.TupleGetItem(out, i) for i in range(3)]
    if len(shape) != 2:
        parts = [bb.emit(relax.op.reshape(p, s)) for p, s in zip(parts, shapes, strict=True)]
    return relax.Tuple(parts)


def _lut(_choice: IsaChoice, fallback, bb, call):
    """``qnn.lut`` -> :func:`_lut_kernel` (static shapes)."""
    data, table = call.args
    shape = shape_of(data)
    if shape is None:
        return fallback(bb, call)
    axis = None
    if call.attrs is not None and "axis" in call.attrs:  # one table per channel
        axis = int(call.attrs["axis"]) % len(shape)
    return _call_lut(bb, _lut_kernel(shape, dtype_of(data), dtype_of(table), axis), data, table)


def _lut_kernel(shape, data_dtype: str, table_dtype: str, axis: int | None = None):
    """The lookup kernel of ``data_dtype`` data of ``shape``, one table or one per channel
    along ``axis``: :func:`autoq.cpu.lut.vbmi_lut_kernel` /
    :func:`autoq.cpu.lut.vbmi_channel_lut_kernel` on targets with AVX-512 VBMI (8-bit
    tables), else :func:`autoq.cpu.lut.lut_kernel` / :func:`autoq.cpu.lut.channel_lut_kernel`."""
    vbmi = table_dtype in VBMI_TABLE_DTYPES and target_has_vbmi()
    if axis is None:
        return (vbmi_lut_kernel if vbmi else lut_kernel)(shape, data_dtype, table_dtype)
    # vpermi2b needs planes of >= 64 elements sharing a table (NCHW): on the last axis
    # (one element per plane) the plain gather is ~100x faster
    kernel = vbmi_channel_lut_kernel if vbmi and _vbmi_planes(shape, axis) else channel_lut_kernel
    return kernel(shape, axis, data_dtype, table_dtype)


def _vbmi_planes(shape, axis: int) -> bool:
    """Whether the planes after ``axis`` of ``shape`` hold >= 64 elements each: the VBMI
    per-channel lookup kernel's domain."""
    return math.prod(int(d) for d in shape[axis + 1 :]) >= 64


def _call_lut(bb, func, data, table):
    """The call of the lookup kernel ``func`` on ``data`` and its table."""
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_lut")
    return relax.call_tir(
        gv, [data, table], out_ty=relax.TensorType(shape_of(data), dtype_of(table))
    )


def _constant_operand_table(call) -> tuple[relax.Expr, np.ndarray] | None:
    """(the 8-bit tensor operand, the table of the op on its codes) of a per-tensor
    ``qnn.add / subtract / multiply`` whose other operand and qparams are constants (``x *
    c``: attention's ``1 / sqrt(d)``), by :func:`autoq.primitives.elementwise`: 256 entries
    for a scalar constant, ``[C, 256]`` for one per channel of NCHW data (``[1, C, 1, 1]``:
    PP-OCRv4 det's bias after its first conv transpose); None for any other call."""
    a, b, *qparams = call.args
    values = [const_array(q) for q in qparams]
    rounding, out_dtype = str(call.attrs["rounding"]), str(call.attrs["out_dtype"])
    if call.attrs.get("axis") is not None or rounding == "tflite" or out_dtype not in _ACT_DTYPES:
        return None
    if any(v is None or v.size != 1 for v in values):
        return None
    (ca, cb) = const_array(a), const_array(b)
    data, const = (b, ca) if cb is None else (a, cb)
    shape = shape_of(data)
    if const is None or dtype_of(data) not in _ACT_DTYPES:
        return None
    if shape is None or shape != shape_of(call):  # (a rank-raising constant)
        return None
    lo, hi = (-128, 128) if dtype_of(data) == "int8" else (0, 256)
    codes = np.arange(lo, hi, dtype=np.int64)
    if const.size == 1:
        const = np.int64(const.reshape(-1)[0])
    elif len(shape) == 4 and (1,) * (4 - const.ndim) + const.shape == (1, shape[1], 1, 1):
        codes, const = codes[None, :], const.reshape(-1, 1).astype(np.int64)
    else:
        return None
    sa, za, sb, zb, so, zo = (v.reshape(-1)[0] for v in values)
    lhs, rhs = (codes, const) if data is a else (const, codes)
    kind = call.op.name.split(".")[1]
    table = P.elementwise(kind, lhs, sa, za, rhs, sb, zb, so, zo, out_dtype, rounding)
    return data, np.asarray(table).astype(out_dtype)


def _elementwise(choice: IsaChoice, fallback, bb, call):
    """A constant-operand elementwise op (:func:`_constant_operand_table`) -> its lookup
    kernel (:func:`_lut_kernel`, per channel along axis 1 for a per-channel constant) on
    targets with AVX-512 VBMI; an add / subtract of two 8-bit tensors on targets dividing by
    a reciprocal -> :func:`autoq.cpu.reciprocal_elementwise.reciprocal_elementwise` when it
    applies; anything else -> ``fallback``. A per-channel constant on
    planes under 64 elements keeps ``fallback`` too: the gather kernel there is slower than
    the float chain, which fuses with its neighbours (ResNet-50 open_nsfw's two 7x7 batch-norm
    shifts: 67 us of lookups + 22 us vs one 74 us fused chain, 1 thread)."""
    found = _constant_operand_table(call) if target_has_vbmi() else None
    if found is None:
        out = reciprocal_elementwise(bb, call) if choice.isa.reciprocal else None
        return fallback(bb, call) if out is None else out
    data, table = found
    axis = 1 if table.ndim == 2 else None
    if axis is not None and not _vbmi_planes(shape_of(data), axis):
        return fallback(bb, call)
    func = _lut_kernel(shape_of(data), dtype_of(data), str(table.dtype), axis)
    return _call_lut(bb, func, data, relax.const(table))


def _requantize(choice: IsaChoice, fallback, bb, call):
    """An 8-bit -> 8-bit ``qnn.requantize`` on targets dividing by a reciprocal ->
    :func:`autoq.cpu.reciprocal_elementwise.reciprocal_requantize` when it applies;
    anything else -> ``fallback``."""
    out = reciprocal_requantize(bb, call) if choice.isa.reciprocal else None
    return fallback(bb, call) if out is None else out


def _max_pool2d(_choice: IsaChoice, fallback, bb, call):
    (data,) = call.args
    a = call.attrs
    shape, out = shape_of(data), shape_of(call)
    plain = str(a.layout) == "NCHW" and str(a.out_layout) == "NCHW"
    if shape is None or out is None or dtype_of(data) not in POOL_DTYPES or not plain:
        return fallback(bb, call)
    if any(int(d) != 1 for d in a.dilation) or len(a.padding) != 4:
        return fallback(bb, call)
    ints = [[int(v) for v in vs] for vs in (a.pool_size, a.strides, a.padding)]
    func = max_pool2d_kernel(shape, dtype_of(data), *ints, out[2:])
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_max_pool2d")
    return relax.call_tir(gv, [data], out_ty=relax.TensorType(out, dtype_of(data)))


_LOWERINGS = {
    "qnn.conv2d": _conv2d,
    "qnn.dense": _dense,
    "qnn.matmul": _matmul,
    "relax.nn.conv2d_transpose": _conv2d_transpose,
    "relax.nn.softmax": _softmax,
    "relax.nn.layer_norm": _layer_norm,
    "qnn.lut": _lut,
    "qnn.add": _elementwise,
    "qnn.subtract": _elementwise,
    "qnn.multiply": _elementwise,
    "qnn.dynamic_quantize": _dynamic_quantize,
    "qnn.requantize": _requantize,
    "relax.nn.max_pool2d": _max_pool2d,
}


def lower_to_cpu_kernels(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    blocked_layout: bool | None = None,
    residual_epilogue: bool | None = None,
) -> tvm.IRModule:
    """``mod`` legalized with the packed kernels for ``target``'s instruction set (unchanged
    when the target has neither AVX-512 VNNI nor AVX2; dense with >= ``AMX_MIN_ROWS`` rows
    on AMX tiles when the target has ``amx-int8``, see :func:`autoq.cpu.isa.kernel_isa`).
    ``blocked_layout``: int8 tensors between packed convs flow in the target's blocked
    layout (:mod:`autoq.cpu.blocked`) instead of NCHW; None: the instruction set's default
    (:attr:`autoq.cpu.isa.Isa.blocked`: on for VNNI and AVX2). ``residual_epilogue``:
    a conv's residual add (and the requantize after it) runs in the conv kernel's epilogue
    (:mod:`autoq.cpu.residual`), the shortcut read blocked when it flows blocked, and (with
    the blocked layout) plain int8 elementwise ops (``qnn.add`` of two blocked tensors, a
    per-tensor requantize) run on blocked tensors (:mod:`autoq.cpu.blocked_elementwise`);
    None: on exactly when the blocked layout is. Requantizes of int8 codes before max pools
    and edge pads move after them first (:mod:`autoq.cpu.pool_requantize`, exact), quantized
    nearest resizes run on the codes (:mod:`autoq.cpu.resize_codes`) and, on VBMI targets,
    channel gates ``x + x * g[c]`` as per-channel lookups whose tables are built at run time
    (:mod:`autoq.cpu.gate_tables`); both exact."""
    choice = isa_choice(target, mod, blocked_layout)
    if choice is None:
        return mod
    isa = choice.isa
    custom = {}
    for name, lower in _LOWERINGS.items():
        own = tvm.ir.Op.get(name).get_attr("FLegalize")
        custom[name] = functools.partial(lower, choice, own)
    residual = choice.blocked if residual_epilogue is None else residual_epilogue
    with target:
        layouts = (None, None)
        if choice.blocked:
            layouts = (functools.partial(_layout_of, choice), functools.partial(lut_layout, isa))
        residuals = (None, None)
        if residual:
            residuals = (
                functools.partial(_takes_residual, choice),
                functools.partial(layout_for, isa, zero_point=0),
            )
        mod = requantize_after_pools(mod)
        mod = resize_codes(mod)
        if target_has_vbmi():  # the run-time tables' lookups: VBMI channel kernels
            mod = gate_tables(mod)
        epilogue = functools.partial(_with_epilogue, choice)
        mod = fuse_epilogues(mod, epilogue, *layouts, *residuals)
        raw = functools.partial(_raw_dense, isa)
        mod = merge_sibling_dense(mod, _runtime_zero_point_operands, raw)
        mod = fold_dequantize_into_softmax(mod, _softmax_call)
        return relax.transform.LegalizeOps(customize_legalize_map=custom)(mod)
