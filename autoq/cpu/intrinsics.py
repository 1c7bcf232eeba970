"""The int8 dot-product tensor intrinsics autoq's CPU kernels are tensorized with.

Both compute ``C[i] += int32(A[k]) * int32(B[i, k])`` over a ``lanes x k`` block of B that is
contiguous in memory and a ``k``-element word of A broadcast to every lane:

- ``autoq_dot_16x4_vnni``: uint8 A, int8 B, 16 lanes x 4 (``vpdpbusd`` on a zmm register).
  TVM's own ``dot_16x4_vnni`` does not compile with LLVM >= 22 (the instruction's operands
  became ``<64 x i8>``), so this one bitcasts its operands first.
- ``autoq_dot_8x2_avx2``: int16 A and B, 8 lanes x 2 (``vpmaddwd`` on a ymm register). The
  int16 products and their pair sums are exact in int32, so unlike ``vpmaddubsw`` nothing
  saturates; the kernels widen int8 to int16 once when packing.

Registration is idempotent (``override=True``) and imports nothing of
``tvm.s_tir.tensor_intrin`` (that package takes tens of seconds to import). The TVMScript
functions are parsed at the first registration, not at import (each ``T.prim_func`` reads the
caller's stack, which costs seconds with torch loaded), and within
:func:`autoq.cpu.tensor_intrinsics.cheap_tvmscript_stack`; parsed once per process.
"""

from __future__ import annotations

import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from autoq.cpu.tensor_intrinsics import cheap_tvmscript_stack

__all__ = ["AVX2_DOT", "VNNI_DOT", "dot_functions", "register_intrinsics"]

VNNI_DOT = "autoq_dot_16x4_vnni"
AVX2_DOT = "autoq_dot_8x2_avx2"


def _dot_desc(lanes: int, k: int, a_dtype: str, b_dtype: str):
    """The description both intrinsics share: ``C[i] += int32(A[k]) * int32(B[i, k])`` over a
    ``lanes x k`` block of B, int32 accumulators."""

    @T.prim_func(s_tir=True)
    def desc(
        A: T.Buffer((k,), a_dtype, offset_factor=1),
        B: T.Buffer((lanes, k), b_dtype, offset_factor=1),
        C: T.Buffer((lanes,), "int32", offset_factor=1),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:k], B[0:lanes, 0:k])
            T.writes(C[0:lanes])
            for i in T.serial(0, lanes):
                for j in T.serial(0, k):
                    with T.sblock("update"):
                        vi, vj = T.axis.remap("SR", [i, j])
                        C[vi] = C[vi] + T.cast(A[vj], "int32") * T.cast(B[vi, vj], "int32")

    return desc


def _vnni_impl():
    """The VNNI implementation: ``vpdpbusd`` on bitcast zmm operands."""

    @T.prim_func(s_tir=True)
    def vnni_impl(
        A: T.Buffer((4,), "uint8", offset_factor=1),
        B: T.Buffer((16, 4), "int8", offset_factor=1),
        C: T.Buffer((16,), "int32", offset_factor=1),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            a_word = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            a_u8 = T.reinterpret(T.broadcast(a_word, 16), dtype="uint8x64")
            b_i8 = B.vload([0, 0], dtype="int8x64")
            C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                C.vload([0], dtype="int32x16"),
                a_u8,
                b_i8,
                dtype="int32x16",
            )

    return vnni_impl


def _avx2_impl():
    """The AVX2 implementation: ``vpmaddwd`` on int16 ymm operands, added to C."""

    @T.prim_func(s_tir=True)
    def avx2_impl(
        A: T.Buffer((2,), "int16", offset_factor=1),
        B: T.Buffer((8, 2), "int16", offset_factor=1),
        C: T.Buffer((8,), "int32", offset_factor=1),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:8], A[0:2], B[0:8, 0:2])
            T.writes(C[0:8])
            a_word = T.reinterpret(A.vload([0], "int16x2"), dtype="int32")
            a_i16 = T.reinterpret(T.broadcast(a_word, 8), dtype="int16x16")
            C[T.ramp(T.int32(0), 1, 8)] = C.vload([0], dtype="int32x8") + T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx2.pmadd.wd"),
                a_i16,
                B.vload([0, 0], dtype="int16x16"),
                dtype="int32x8",
            )

    return avx2_impl


@functools.cache
def dot_functions() -> dict[str, tuple]:
    """``{intrinsic name: (desc, impl)}``, the TVMScript functions parsed at the first call
    within :func:`~autoq.cpu.tensor_intrinsics.cheap_tvmscript_stack`, cached.

    >>> sorted(dot_functions()) == sorted([VNNI_DOT, AVX2_DOT])
    True
    """
    with cheap_tvmscript_stack():
        return {
            VNNI_DOT: (_dot_desc(16, 4, "uint8", "int8"), _vnni_impl()),
            AVX2_DOT: (_dot_desc(8, 2, "int16", "int16"), _avx2_impl()),
        }


def register_intrinsics() -> None:
    """Register both intrinsics with TVM (safe to call any number of times)."""
    for name, (desc, impl) in dot_functions().items():
        TensorIntrin.register(name, desc, impl, override=True)
