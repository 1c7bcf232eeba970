"""Which int8 dot-product instruction a CPU target has, and what the kernels need for it.

An :class:`Isa` row holds everything that differs between the instruction sets: the
intrinsic, its block shape (``lanes`` output channels x ``k`` reduction elements), the dtype
activations and weights are packed to, and how signed/unsigned activations are shifted into
the activation dtype. :func:`isa_of` picks the row from the target's CPU features.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from .intrinsics import AVX2_DOT, VNNI_DOT

__all__ = ["AVX2", "ISAS", "VNNI", "Isa", "isa_of"]


@dataclass(frozen=True)
class Isa:
    """One instruction set's kernel parameters.

    ``centered``: activations are packed as ``x - zero_point`` (int16 holds it exactly, no
    compensation term); otherwise they are packed as ``x + 128`` for int8 data / ``x`` for
    uint8 data (uint8), and ``(zero_point + shift) * sum(w)`` is subtracted afterwards.
    """

    name: str
    feature: str
    intrinsic: str
    lanes: int
    k: int
    act_dtype: str
    weight_dtype: str
    centered: bool

    def shift(self, data_dtype: str, zero_point: int) -> int:
        """What is added to an activation to get its packed value.

        >>> VNNI.shift("int8", 3), VNNI.shift("uint8", 3), AVX2.shift("int8", 3)
        (128, 0, -3)
        """
        if self.centered:
            return -zero_point
        return 128 if data_dtype == "int8" else 0


VNNI = Isa("vnni", "avx512vnni", VNNI_DOT, 16, 4, "uint8", "int8", centered=False)
AVX2 = Isa("avx2", "avx2", AVX2_DOT, 8, 2, "int16", "int16", centered=True)
# preferred first
ISAS = (VNNI, AVX2)


def isa_of(target: tvm.target.Target) -> Isa | None:
    """The best int8 instruction set of an LLVM x86 target, None for any other target.

    ``{"kind": "llvm", "mcpu": "znver4"}`` -> VNNI, ``"znver3"``/``"haswell"`` -> AVX2, a
    bare ``{"kind": "llvm"}`` (generic x86-64) -> None.
    """
    if target.kind.name != "llvm":
        return None
    for isa in ISAS:
        if tvm.target.codegen.target_has_features(isa.feature, target):
            return isa
    return None
