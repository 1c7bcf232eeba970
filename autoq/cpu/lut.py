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
* :func:`blocked_channel_lut_kernel`: one table per channel on the channel-blocked layout
  ``[N, C / lanes, H, W, lanes]`` of :mod:`autoq.cpu.blocked` (the stored byte is the
  index; channel ``c * lanes + i`` for lane ``i`` of block ``c``): a gather per element,
  parallel over (batch, channel block, row), the lanes vectorized.
  :func:`vbmi_blocked_channel_lut_kernel` (VBMI): 64 pixels x 16 channels at a time are
  transposed in registers to one vector per channel (:func:`transpose_stages`: four rounds
  of two-register byte permutes), looked up as above and transposed back;
  :func:`vbmi_blocked_channel_lut_kernel` with ``nchw`` stores the looked-up channel vectors NCHW
  instead (no transpose back): a lookup whose output is not read blocked (a resize, a
  float op, a model output) still reads its conv's blocked output.
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

import functools
import math

import numpy as np
import tvm
from tvm import te, tirx
from tvm.s_tir import Schedule
from tvm.script import tirx as T

from autoq.cpu.injective import KERNEL_ATTR, memoized_kernel, schedule_fused
from autoq.cpu.tiling import i64

__all__ = [
    "VBMI_TABLE_DTYPES",
    "blocked_channel_lut_kernel",
    "channel_lut_kernel",
    "current_target_has",
    "lut_kernel",
    "transpose_picks",
    "transpose_stages",
    "vbmi_blocked_channel_lut_kernel",
    "vbmi_channel_lut_kernel",
    "vbmi_lut_kernel",
]

VBMI_TABLE_DTYPES = ("int8", "uint8")
_W = 64  # bytes per AVX-512 register
_VECTORS_PER_TASK = 64
_PERMUTE = "llvm.x86.avx512.vpermi2var.qi.512"


def current_target_has(feature: str) -> bool:
    """Whether the current target (``with target:``; False outside one) has the LLVM
    ``feature`` (``"avx512vbmi"``, ``"avx512f"``, ...)."""
    target = tvm.target.Target.current(allow_none=True)
    return target is not None and tvm.target.codegen.target_has_features(feature, target)


def target_has_vbmi() -> bool:
    """Whether the current target has AVX-512 VBMI (``vpermi2b``: the 256-entry lookups)."""
    return current_target_has("avx512vbmi")


def _qmin(data_dtype: str) -> int:
    return -128 if data_dtype == "int8" else 0


@memoized_kernel
def lut_kernel(shape, data_dtype: str, table_dtype: str) -> tirx.PrimFunc:
    """PrimFunc ``(data[shape], table[256], out[shape])``."""
    qmin = _qmin(data_dtype)
    data = te.placeholder(i64(*shape), data_dtype, name="data")
    table = te.placeholder(i64(256), table_dtype, name="table")
    out = te.compute(data.shape, lambda *i: table[data[i].astype("int32") - qmin], name="autoq_lut")
    func = schedule_fused(te.create_prim_func([data, table, out]))
    return func.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


@memoized_kernel
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


@memoized_kernel
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


@memoized_kernel
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


def blocked_channel_lut_kernel(shape, table_dtype: str) -> tirx.PrimFunc:
    """PrimFunc ``(data[shape], table[C, 256], out[shape])`` for blocked ``uint8`` data of
    ``shape = (N, C / lanes, H, W, lanes)`` (``C`` = blocks x lanes): lane ``i`` of block
    ``c`` reads row ``c * lanes + i`` at the stored byte."""
    n, blocks, h, w, lanes = (int(d) for d in shape)
    data = te.placeholder((n, blocks, h, w, lanes), "uint8", name="data")
    table = te.placeholder((blocks * lanes, 256), table_dtype, name="table")
    out = te.compute(
        data.shape,
        lambda b, c, y, x, i: table[c * lanes + i, data[b, c, y, x, i].astype("int32")],
        name="autoq_lut",
    )
    sch = Schedule(te.create_prim_func([data, table, out]))
    b, c, y, _, i = sch.get_loops(sch.get_sblock("autoq_lut"))
    sch.parallel(sch.fuse(b, c, y))
    sch.vectorize(i)
    return sch.mod["main"].with_attrs({"op_pattern": 8, KERNEL_ATTR: True})


def transpose_stages(to_channels: bool) -> list[tuple[list[int], list[int]]]:
    """The byte picks of the 16 x 64-byte transpose between 64 pixels of 16 channels
    (vector ``v`` lane ``l`` = pixel ``4 v + l // 16``, channel ``l % 16``) and one vector
    per channel (vector ``j`` lane ``p``: pixel ``p``, channel ``j``), ``to_channels`` or
    back: in round ``k`` each pair of vectors ``(v, v + 2**k)`` (bit ``k`` of ``v`` clear)
    becomes the two vectors ``(low, high)`` that pick these lanes of the pair's 128 bytes,
    split by bit ``k`` of the channel (to channels) or bit ``k + 2`` of the pixel (back).
    The same picks serve every pair of a round.

    >>> import numpy as np
    >>> x = np.arange(1024).reshape(16, 64)  # 64 pixels x 16 channels, blocked
    >>> def run(vectors, stages):
    ...     for r, (low, high) in enumerate(stages):
    ...         out = list(vectors)
    ...         for v in range(16):
    ...             if not v >> r & 1:
    ...                 pair = np.concatenate([vectors[v], vectors[v | 1 << r]])
    ...                 out[v], out[v | 1 << r] = pair[low], pair[high]
    ...         vectors = out
    ...     return np.stack(vectors)
    >>> channels = run(list(x), transpose_stages(True))
    >>> bool((channels == x.reshape(64, 16).T).all())
    True
    >>> bool((run(list(channels), transpose_stages(False)) == x).all())
    True
    """
    if to_channels:
        vectors = [[v * _W + lane for lane in range(_W)] for v in range(16)]
    else:
        vectors = [[p * 16 + j for p in range(_W)] for j in range(16)]
    stages = []
    for r in range(4):
        bit = r if to_channels else r + 2
        pair = vectors[0] + vectors[1 << r]  # (every pair has this structure)
        where = {e: i for i, e in enumerate(pair)}
        split = [e for e in sorted(pair) if not (e % 16 if to_channels else e // 16) >> bit & 1]
        rest = [e for e in sorted(pair) if e not in set(split)]
        stages.append(([where[e] for e in split], [where[e] for e in rest]))
        for v in range(16):
            if not v >> r & 1:
                both = sorted(vectors[v] + vectors[v | 1 << r])
                key = (lambda e: e % 16) if to_channels else (lambda e: e // 16)
                vectors[v] = [e for e in both if not key(e) >> bit & 1]
                vectors[v | 1 << r] = [e for e in both if key(e) >> bit & 1]
    return stages


_GROUP = 16 * _W  # bytes of one transposed group: 64 pixels x 16 channels
_GROUPS_PER_TASK = 16


def transpose_picks() -> np.ndarray:
    """The ``[16, 64]`` int8 ``vpermi2b`` indices :func:`vbmi_blocked_channel_lut_kernel`
    takes: row ``4 d + r`` pairs with ``8 + 4 d + r`` as the (low, high) picks of round
    ``r`` of :func:`transpose_stages` (``d`` 0: to channels, 1: back).

    >>> transpose_picks().shape, int(transpose_picks().max())
    ((16, 64), 127)
    """
    stages = transpose_stages(True) + transpose_stages(False)
    return np.array([s[0] for s in stages] + [s[1] for s in stages], np.int8)


def _permute(first, index, second):
    """``vpermi2b``: the bytes of (``first``, ``second``) at ``index``'s low 7 bits."""
    return T.call_llvm_pure_intrin(f"int8x{_W}", _PERMUTE, first, index, second)


def _looked_up(table, row, v):
    """The bytes of ``table`` (one 256-byte row from ``row``) at the 64 stored bytes ``v``
    (read as int8: the top bit picks the second half)."""
    lo = _permute(table[T.Ramp(row, 1, _W)], v, table[T.Ramp(row + _W, 1, _W)])
    hi = _permute(table[T.Ramp(row + 128, 1, _W)], v, table[T.Ramp(row + 192, 1, _W)])
    return T.Select(v < T.Broadcast(T.int8(0), _W), hi, lo)


@T.macro
def _transpose_round(src, dst, src_base, dst_base, picks, row):
    """Round ``row % 4`` of :func:`transpose_stages` (rows 0-3 of :func:`transpose_picks`:
    to channels, 4-7: back) on the group of 16 vectors at ``src_base``, into ``dst``."""
    r = row % 4
    for pr in range(8):  # the pairs (v, v + 2**r), bit r of v clear
        v = (pr >> r << r + 1) | (pr & (1 << r) - 1)
        first = src[T.Ramp(src_base + v * _W, 1, _W)]
        second = src[T.Ramp(src_base + (v + (1 << r)) * _W, 1, _W)]
        low, high = picks[T.Ramp(row * _W, 1, _W)], picks[T.Ramp((row + 8) * _W, 1, _W)]
        dst[T.Ramp(dst_base + v * _W, 1, _W)] = _permute(first, low, second)
        dst[T.Ramp(dst_base + (v + (1 << r)) * _W, 1, _W)] = _permute(first, high, second)


@T.macro
def _to_channels(x, base, a, c, picks):
    """The group of 64 pixels x 16 channels at ``base`` of ``x`` as one vector per channel
    in ``c`` (``a``: scratch)."""
    _transpose_round(x, a, base, 0, picks, 0)
    _transpose_round(a, c, 0, 0, picks, 1)
    _transpose_round(c, a, 0, 0, picks, 2)
    _transpose_round(a, c, 0, 0, picks, 3)


@functools.cache
def vbmi_blocked_channel_lut_kernel(table_dtype: str, nchw: bool = False) -> tirx.PrimFunc:
    """PrimFunc ``(data[N, B, H, W, 16], table[16 B, 256], picks[16, 64], out)`` (any
    shape, bound at run time: one kernel for every layer): :func:`blocked_channel_lut_kernel`
    (``table_dtype`` one of :data:`VBMI_TABLE_DTYPES`) with ``vpermi2b``, ``picks`` =
    :func:`transpose_picks`: each group of 64 pixels of a channel block is transposed to 16
    channel vectors, looked up, transposed back; the last ``H * W % 64`` pixels of each
    block by a scalar gather.

    ``nchw``: ``out`` is ``[N, C, H, W]`` (``C <= 16 B``, bound at run time): each looked-up
    channel vector is 64 consecutive bytes of its channel's plane (no transpose back), the
    channels past ``C`` (a block's padding) are not stored. Its input is a conv kernel's
    blocked output (a conv stores NCHW much slower: a strided read of its accumulators)."""

    @T.prim_func
    def vbmi_blocked_channel_lut(x_h: T.handle, table_h: T.handle, picks_h: T.handle,
                                 out_h: T.handle):  # fmt: skip
        T.func_attr({"tirx.noalias": True})
        n, blocks, h, w, channels = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        x_in = T.match_buffer(x_h, (n, blocks, h, w, 16), "uint8")
        table_in = T.match_buffer(table_h, (blocks * 16, 256), table_dtype)
        picks_in = T.match_buffer(picks_h, (16, _W), "int8")
        out_ = T.match_buffer(
            out_h, (n, channels, h, w) if nchw else (n, blocks, h, w, 16), table_dtype
        )
        plane = T.meta_var(h * w * 16)  # bytes per (batch, channel block)
        groups = T.meta_var(plane // _GROUP)
        chunks = T.meta_var(T.max((groups + _GROUPS_PER_TASK - 1) // _GROUPS_PER_TASK, 1))
        planes = T.meta_var(n * blocks)
        total = T.meta_var(planes * plane)
        x = T.decl_buffer((total,), "int8", data=x_in.data)
        index = T.decl_buffer((total,), "uint8", data=x_in.data)
        table = T.decl_buffer((blocks * 16 * 256,), "int8", data=table_in.data)
        picks = T.decl_buffer((16 * _W,), "int8", data=picks_in.data)
        out = T.decl_buffer((n * channels * h * w if nchw else total,), "int8", data=out_.data)
        for task in T.parallel(planes * chunks):
            b = task // chunks
            first = task % chunks * _GROUPS_PER_TASK
            for g in range(T.min(_GROUPS_PER_TASK, groups - first)):
                base = b * plane + (first + g) * _GROUP
                a = T.alloc_buffer((_GROUP,), "int8", scope="local")
                c = T.alloc_buffer((_GROUP,), "int8", scope="local")
                _to_channels(x, base, a, c, picks)
                for j in range(16):  # channel ch's 64 pixels
                    ch = (b % blocks) * 16 + j
                    v = c[T.Ramp(j * _W, 1, _W)]
                    if nchw:
                        if ch < channels:
                            at = ((b // blocks) * channels + ch) * (h * w) + (first + g) * _W
                            out[T.Ramp(at, 1, _W)] = _looked_up(table, ch * 256, v)
                    else:
                        a[T.Ramp(j * _W, 1, _W)] = _looked_up(table, ch * 256, v)
                if not nchw:
                    _transpose_round(a, c, 0, 0, picks, 4)
                    _transpose_round(c, a, 0, 0, picks, 5)
                    _transpose_round(a, c, 0, 0, picks, 6)
                    _transpose_round(c, out, 0, base, picks, 7)
        for b in T.parallel(planes):
            for k in range(plane - groups * _GROUP):
                i = b * plane + groups * _GROUP + k
                ch = (b % blocks) * 16 + i % 16
                if nchw:
                    if ch < channels:
                        at = ((b // blocks) * channels + ch) * (h * w) + groups * _W + k // 16
                        out[at] = table[ch * 256 + T.Cast("int32", index[i])]
                else:
                    out[i] = table[ch * 256 + T.Cast("int32", index[i])]

    return vbmi_blocked_channel_lut.with_attrs({"op_pattern": 8, KERNEL_ATTR: True})
