"""``qnn.lut`` as one kernel: ``out[i] = table[data[i] - qmin]``.

The generic legalization materializes ``int32(data) - qmin`` (four bytes per element, fused
into the requantize before it) and then calls ``take``. These kernels read the 8-bit data
directly. They stay opaque to FuseOps like ``take``: fused into its neighbours, the gather
stops LLVM from vectorizing the requantize and float ops around it (measured 5% slower on
PP-OCRv4 det). Same values: every int8/uint8 input is a valid table index.

* :func:`lut_kernel`: a scalar gather, parallel over the leading axes (any target).
* :func:`channel_lut_kernel` / :func:`vbmi_channel_lut_kernel`: the same with one table per
  channel (``[C, 256]``, ``qnn.lut`` with ``axis``; :mod:`autoq.rules.lut_channels`): the VBMI one
  runs plane by plane (the elements after ``axis`` are contiguous and share a table), the
  four table registers loaded per plane.
* :func:`vbmi_lut_kernel` (targets with AVX-512 VBMI, 8-bit tables): the 256-byte table
  lives in four 64-byte registers; 64 inputs at a time go through two ``vpermi2b`` (each
  picks from 128 table bytes by the input's low 7 bits) and the input's top bit chooses
  between them. 12x the gather on a 1x32x240x240 hardswish table (0.16 vs 1.9 ms, 1 thread).

The index bits: for int8 data ``v``, ``table[v + 128]``: the low 7 bits of ``v`` index
within a half and ``v < 0`` selects the first half; for uint8 data the second half is
``v >= 128``, i.e. ``v`` read as int8 is negative.

>>> import numpy as np
>>> table, v = np.arange(256) * 3, np.arange(-128, 128).astype(np.int8)
>>> low7 = v.view(np.uint8) & 127
>>> picked = np.where(v < 0, table[:128][low7], table[128:][low7])
>>> bool((picked == table[v.astype(np.int32) + 128]).all())
True
"""

from __future__ import annotations

import math

from tvm import te, tirx
from tvm.script import tirx as T

from autoq.cpu.injective import KERNEL_ATTR, schedule_fused
from autoq.cpu.tiling import i64

__all__ = [
    "VBMI_TABLE_DTYPES",
    "channel_lut_kernel",
    "lut_kernel",
    "vbmi_channel_lut_kernel",
    "vbmi_lut_kernel",
]

VBMI_TABLE_DTYPES = ("int8", "uint8")
_W = 64  # bytes per AVX-512 register
_VECTORS_PER_TASK = 64
_PERMUTE = "llvm.x86.avx512.vpermi2var.qi.512"


def _qmin(data_dtype: str) -> int:
    return -128 if data_dtype == "int8" else 0


def lut_kernel(shape, data_dtype: str, table_dtype: str) -> tirx.PrimFunc:
    """PrimFunc ``(data[shape], table[256], out[shape])``."""
    qmin = _qmin(data_dtype)
    data = te.placeholder(i64(*shape), data_dtype, name="data")
    table = te.placeholder(i64(256), table_dtype, name="table")
    out = te.compute(data.shape, lambda *i: table[data[i].astype("int32") - qmin], name="autoq_lut")
    func = schedule_fused(te.create_prim_func([data, table, out]))
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def vbmi_lut_kernel(shape, data_dtype: str, table_dtype: str) -> tirx.PrimFunc:
    """PrimFunc ``(data[shape], table[256], out[shape])`` with ``vpermi2b`` (AVX-512 VBMI;
    ``table_dtype`` one of :data:`VBMI_TABLE_DTYPES`); the last ``size % 64`` elements by a
    scalar gather."""
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    nv, qmin, vec = n // _W, _qmin(data_dtype), f"{table_dtype}x{_W}"
    tasks = -(-nv // _VECTORS_PER_TASK)
    low_if_negative = data_dtype == "int8"

    def permute(table, first: int, v):
        return T.call_llvm_pure_intrin(
            vec, _PERMUTE, table[T.Ramp(first, 1, _W)], v, table[T.Ramp(first + _W, 1, _W)]
        )

    @T.prim_func
    def vbmi_lut(
        x_in: T.Buffer(shape, data_dtype),
        table: T.Buffer((256,), table_dtype),
        out_: T.Buffer(shape, table_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        x = T.decl_buffer((n,), data_dtype, data=x_in.data)
        signed = T.decl_buffer((n,), "int8", data=x_in.data)
        out = T.decl_buffer((n,), table_dtype, data=out_.data)
        for task in T.parallel(tasks):
            for j in range(T.min(_VECTORS_PER_TASK, nv - task * _VECTORS_PER_TASK)):
                base = (task * _VECTORS_PER_TASK + j) * _W
                v = signed[T.Ramp(base, 1, _W)]
                negative = v < T.Broadcast(T.int8(0), _W)
                if low_if_negative:
                    out[T.Ramp(base, 1, _W)] = T.Select(
                        negative, permute(table, 0, v), permute(table, 128, v)
                    )
                else:
                    out[T.Ramp(base, 1, _W)] = T.Select(
                        negative, permute(table, 128, v), permute(table, 0, v)
                    )
        for k in range(n - nv * _W):
            out[nv * _W + k] = table[T.Cast("int32", x[nv * _W + k]) - qmin]

    return vbmi_lut.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def channel_lut_kernel(shape, axis: int, data_dtype: str, table_dtype: str) -> tirx.PrimFunc:
    """PrimFunc ``(data[shape], table[C, 256], out[shape])``, ``C = shape[axis]``: the
    table of each element's channel."""
    qmin, axis = _qmin(data_dtype), axis % len(shape)
    data = te.placeholder(i64(*shape), data_dtype, name="data")
    table = te.placeholder(i64(int(shape[axis]), 256), table_dtype, name="table")
    out = te.compute(
        data.shape,
        lambda *i: table[i[axis], data[i].astype("int32") - qmin],
        name="autoq_lut",
    )
    func = schedule_fused(te.create_prim_func([data, table, out]))
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def vbmi_channel_lut_kernel(shape, axis: int, data_dtype: str, table_dtype: str) -> tirx.PrimFunc:
    """PrimFunc ``(data[shape], table[C, 256], out[shape])`` with ``vpermi2b``, one plane
    (the elements sharing the index up to ``axis``) per task; each plane's last
    ``size % 64`` elements by a scalar gather."""
    shape = tuple(int(d) for d in shape)
    axis = axis % len(shape)
    channels, plane = shape[axis], math.prod(shape[axis + 1 :])
    planes, n = math.prod(shape[: axis + 1]), math.prod(shape)
    nv, qmin, vec = plane // _W, _qmin(data_dtype), f"{table_dtype}x{_W}"
    first_half_if_negative = data_dtype == "int8"

    def permute(table, first, v):
        return T.call_llvm_pure_intrin(
            vec, _PERMUTE, table[T.Ramp(first, 1, _W)], v, table[T.Ramp(first + _W, 1, _W)]
        )

    @T.prim_func
    def vbmi_channel_lut(
        x_in: T.Buffer(shape, data_dtype),
        table_in: T.Buffer((channels, 256), table_dtype),
        out_: T.Buffer(shape, table_dtype),
    ):
        T.func_attr({"tirx.noalias": True})
        x = T.decl_buffer((n,), data_dtype, data=x_in.data)
        signed = T.decl_buffer((n,), "int8", data=x_in.data)
        table = T.decl_buffer((channels * 256,), table_dtype, data=table_in.data)
        out = T.decl_buffer((n,), table_dtype, data=out_.data)
        for p in T.parallel(planes):
            row = (p % channels) * 256
            for j in range(nv):
                base = p * plane + j * _W
                v = signed[T.Ramp(base, 1, _W)]
                negative = v < T.Broadcast(T.int8(0), _W)
                if first_half_if_negative:
                    out[T.Ramp(base, 1, _W)] = T.Select(
                        negative, permute(table, row, v), permute(table, row + 128, v)
                    )
                else:
                    out[T.Ramp(base, 1, _W)] = T.Select(
                        negative, permute(table, row + 128, v), permute(table, row, v)
                    )
            for k in range(plane - nv * _W):
                i = p * plane + nv * _W + k
                out[i] = table[row + T.Cast("int32", x[i]) - qmin]

    return vbmi_channel_lut.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
