"""The VNNI tensor intrinsic ``dot_16x4_vnni`` with an implementation that compiles with the
LLVM inside the apache-tvm 0.27 wheel.

TVM's stock implementation (``tvm.s_tir.tensor_intrin.x86``) passes the broadcast activation
word and the weights to ``llvm.x86.avx512.vpdpbusd.512`` as ``int32x16``; LLVM 22 declares
the intrinsic's operands as ``<64 x i8>`` and refuses the call ("Call parameter type does not
match function signature"), so every MetaSchedule candidate tensorized with it fails to build.
:func:`register_vnni` registers the same description (``C[i] += int32(A_u8[k]) *
int32(B_i8[i, k])``, 16 lanes x 4) with an implementation that bitcasts both operands to 64
bytes. It must run in every process that applies a schedule using the intrinsic (the tuning
process, and the process compiling with a tuning database); builder workers receive already
tensorized code and do not need it.
"""

from __future__ import annotations

import functools

__all__ = ["VNNI_INTRIN", "register_vnni", "target_has_vnni"]

VNNI_INTRIN = "dot_16x4_vnni"


def target_has_vnni(target) -> bool:
    """Whether the LLVM ``target`` has AVX-512 VNNI (``vpdpbusd``)."""
    from tvm.target import codegen

    mcpu = target.attrs.get("mcpu", "") if target.kind.name == "llvm" else ""
    if not mcpu:
        return False
    return bool(codegen.target_has_features("avx512vnni", target))


def _impl():
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def dot_16x4_u8i8i32_vnni_llvm22(
        A: T.Buffer((4,), "uint8", offset_factor=1),
        B: T.Buffer((16, 4), "int8", offset_factor=1),
        C: T.Buffer((16,), "int32", offset_factor=1),
    ) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            a_word = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
            a_bytes = T.reinterpret(T.broadcast(a_word, 16), dtype="uint8x64")
            b_bytes = B.vload([0, 0], dtype="int8x64")
            acc = C.vload([0], dtype="int32x16")
            C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                acc,
                a_bytes,
                b_bytes,
                dtype="int32x16",
            )

    return dot_16x4_u8i8i32_vnni_llvm22


@functools.cache
def register_vnni() -> None:
    """Register (override) ``dot_16x4_vnni`` with the LLVM 22 compatible implementation.

    Imports ``tvm.s_tir.tensor_intrin`` first (20-90 s the first time in a process: it
    parses every target's intrinsics) so that the stock registration cannot later clash
    with ours. Idempotent."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  (registers the stock intrinsics)
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin.x86 import dot_product_16x4_u8i8i32_desc

    TensorIntrin.register(VNNI_INTRIN, dot_product_16x4_u8i8i32_desc, _impl(), override=True)
