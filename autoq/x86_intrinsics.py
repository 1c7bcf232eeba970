"""MetaSchedule's VNNI tensor intrinsic ``dot_16x4_vnni`` with an implementation that compiles
with the LLVM inside the apache-tvm 0.27 wheel.

TVM's stock implementation (``tvm.s_tir.tensor_intrin.x86``) passes the broadcast activation
word and the weights to ``llvm.x86.avx512.vpdpbusd.512`` as ``int32x16``; LLVM 22 declares
the intrinsic's operands as ``<64 x i8>`` and refuses the call ("Call parameter type does not
match function signature"), so every MetaSchedule candidate tensorized with it fails to build.
:func:`register_vnni` registers, under the stock name that MetaSchedule's x86 rules look for,
the description and implementation of autoq's own kernels (:mod:`autoq.cpu.intrinsics`:
``C[i] += int32(A_u8[k]) * int32(B_i8[i, k])``, 16 lanes x 4, operands bitcast to 64 bytes).
It must run in every process that applies a schedule using the intrinsic (the tuning
process, and the process compiling with a tuning database); builder workers receive already
tensorized code and do not need it.
"""

from __future__ import annotations

import functools

from .cpu.intrinsics import vnni_desc, vnni_impl
from .cpu.isa import VNNI, isa_of

__all__ = ["VNNI_INTRIN", "register_vnni", "target_has_vnni"]

VNNI_INTRIN = "dot_16x4_vnni"


def target_has_vnni(target) -> bool:
    """Whether the LLVM ``target`` has AVX-512 VNNI (``vpdpbusd``)."""
    mcpu = target.attrs.get("mcpu", "") if target.kind.name == "llvm" else ""
    return bool(mcpu) and isa_of(target) is VNNI


@functools.cache
def register_vnni() -> None:
    """Register (override) ``dot_16x4_vnni`` with the LLVM 22 compatible implementation.

    Imports ``tvm.s_tir.tensor_intrin`` first (20-90 s the first time in a process: it
    parses every target's intrinsics) so that the stock registration cannot later clash
    with ours. Idempotent."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  (registers the stock intrinsics)
    from tvm.s_tir import TensorIntrin

    TensorIntrin.register(VNNI_INTRIN, vnni_desc, vnni_impl, override=True)
