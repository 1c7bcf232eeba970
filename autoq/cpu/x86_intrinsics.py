"""TVM's own ``dot_16x4_vnni`` tensor intrinsic, made to compile with the LLVM inside the
apache-tvm 0.27 wheel, for MetaSchedule.

MetaSchedule's x86 rules add ``MultiLevelTilingWithIntrin("dot_16x4_vnni")`` to the search
space of every target with AVX-512 VNNI, but TVM's stock implementation
(``tvm.s_tir.tensor_intrin.x86``) passes ``int32x16`` operands to
``llvm.x86.avx512.vpdpbusd.512``, which LLVM 22 declares with ``<64 x i8>`` operands: every
candidate tensorized with it fails to build. :func:`register_vnni` re-registers the name with
the description and implementation of autoq's own ``autoq_dot_16x4_vnni``
(:mod:`autoq.cpu.intrinsics`: the same computation, operands bitcast to 64 bytes). It must
run in every process that applies a schedule using the intrinsic (the tuning process, and a
process compiling with a tuning database holding such records); builder workers receive
already tensorized code and do not need it.
"""

from __future__ import annotations

import functools

__all__ = ["VNNI_INTRIN", "register_vnni", "target_has_vnni"]

#: the name MetaSchedule's x86 schedule rules look up
VNNI_INTRIN = "dot_16x4_vnni"


def target_has_vnni(target) -> bool:
    """Whether the LLVM ``target`` has AVX-512 VNNI (``vpdpbusd``)."""
    from autoq.cpu.isa import VNNI, isa_of

    return isa_of(target) is VNNI


@functools.cache
def register_vnni() -> None:
    """Register (override) ``dot_16x4_vnni`` with the LLVM 22 compatible implementation.

    Imports ``tvm.s_tir.tensor_intrin`` first (:mod:`autoq.cpu.tensor_intrinsics`, ~2 s) so
    that the stock registration cannot later replace ours. Idempotent."""
    from tvm.s_tir import TensorIntrin

    from autoq.cpu.intrinsics import VNNI_DOT, register_intrinsics
    from autoq.cpu.tensor_intrinsics import import_tensor_intrinsics

    import_tensor_intrinsics()  # the stock intrinsics, registered before ours
    register_intrinsics()
    ours = TensorIntrin.get(VNNI_DOT)
    TensorIntrin.register(VNNI_INTRIN, ours.desc, ours.impl, override=True)
