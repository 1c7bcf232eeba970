"""Which int8 dot-product instruction a CPU target has, and what the kernels need for it.

An :class:`Isa` row holds everything that differs between the instruction sets: the
intrinsic, its block shape (``lanes`` output channels x ``k`` reduction elements), the dtype
activations and weights are packed to, and how signed/unsigned activations are shifted into
the activation dtype. :func:`isa_of` picks the row from the target's CPU features;
:func:`isa_choice` is what one lowering carries: the row for the target and the convs of the
module that stay off AMX.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import tvm
from tvm import relax

from autoq.cpu.amx import target_has_amx
from autoq.cpu.depthwise_neighbours import depthwise_neighbours, weight_key
from autoq.cpu.intrinsics import AVX2_DOT, VNNI_DOT
from autoq.ir.toolkit import const_array

__all__ = ["AVX2", "ISAS", "VNNI", "Isa", "IsaChoice", "isa_choice", "isa_of", "kernel_isa"]


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
    max_tile: int  # rows of the register tile (output columns / GEMM rows)
    out_blocks: int = 2  # lane blocks of output channels per register tile
    amx: bool = False  # dense runs on AMX tiles (autoq.cpu.amx_dense) when it has enough rows
    # int8 activations flow between convs in the blocked layout by default (autoq.cpu.blocked),
    # with the residual epilogue: measured faster on VNNI and, together, on AVX2 (ResNet-50
    # 0.86x of NCHW idle; the blocked layout alone, int16 blocks of 8, was not faster there)
    blocked: bool = True
    # dense register tiles may pad this fraction more rows than the least-padding tile
    # (autoq.cpu.tiling.pick_tile's slack): on AVX2, 6 x 2 tiles on 128 rows (132 padded)
    # measured 0.93-0.98x the time of the unpadded 4 x 2 (SPR, 1 thread, CPU time; K 384..1536)
    row_slack: float = 0.0
    # float requantize epilogues divide by the output scale as a product with its reciprocal
    # and FMA corrections (the same quotient, autoq.cpu.epilogue.Epilogue.reciprocal): on
    # the AMX machine ResNet-50 0.97x the CPU time; on Zen 4 the division was faster
    reciprocal: bool = False

    def channel_blocks(self, channels: int) -> int:
        """Lane blocks per register tile for ``channels`` output channels.

        >>> VNNI.channel_blocks(16), VNNI.channel_blocks(20), AVX2.channel_blocks(64)
        (1, 2, 2)
        """
        return self.out_blocks if channels > self.lanes else 1

    def padded_channels(self, channels: int) -> int:
        """Output channels rounded up to whole register tiles (the packed weights' rows).

        >>> VNNI.padded_channels(16), VNNI.padded_channels(20), AVX2.padded_channels(3)
        (16, 32, 8)
        """
        step = self.lanes * self.channel_blocks(channels)
        return -(-channels // step) * step

    def shift(self, data_dtype: str, zero_point: int) -> int:
        """What is added to an activation to get its packed value.

        >>> VNNI.shift("int8", 3), VNNI.shift("uint8", 3), AVX2.shift("int8", 3)
        (128, 0, -3)
        """
        if self.centered:
            return -zero_point
        return 128 if data_dtype == "int8" else 0


# tiles: VNNI 8 x 2 zmm accumulators of 32 registers, AVX2 6 x 2 ymm of 16
VNNI = Isa("vnni", "avx512vnni", VNNI_DOT, 16, 4, "uint8", "int8", centered=False, max_tile=8)
AVX2 = Isa(
    "avx2", "avx2", AVX2_DOT, 8, 2, "int16", "int16", centered=True, max_tile=6, row_slack=0.05
)
# preferred first
ISAS = (VNNI, AVX2)


def isa_of(target: tvm.target.Target) -> Isa | None:
    """The best int8 instruction set of an LLVM x86 target, None for any other target.

    ``{"kind": "llvm", "mcpu": "znver4"}`` -> VNNI, ``"znver3"``/``"haswell"`` -> AVX2, a
    bare ``{"kind": "llvm"}`` (generic x86-64) -> None. AMX is not a row of its own (its CPUs
    all have VNNI, which the other kernels keep using): see :func:`kernel_isa`.
    """
    if target.kind.name != "llvm":
        return None
    for isa in ISAS:
        if tvm.target.codegen.target_has_features(isa.feature, target):
            return isa
    return None


def kernel_isa(target: tvm.target.Target) -> Isa | None:
    """:func:`isa_of` with ``amx=True`` when the target also has the AMX int8 tile features
    (``mcpu`` ``sapphirerapids``, or ``mattr`` ``+amx-tile``, ``+amx-int8``).

    >>> kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})).amx
    True
    >>> kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})) is VNNI
    True
    """
    isa = isa_of(target)
    if isa is VNNI and target_has_amx(target):
        return replace(VNNI, amx=True, reciprocal=True)
    return isa


@dataclass(frozen=True, eq=False)
class IsaChoice:
    """The instruction sets of one module's kernels: ``isa`` (:func:`kernel_isa` of the
    target), ``blocked`` (int8 tensors between packed convs flow in the blocked layout) and
    ``vnni_convs``, the :func:`~autoq.cpu.depthwise_neighbours.weight_key` of the convs that
    stay on VNNI on an AMX target (the neighbours of depthwise convs: on VNNI their chain
    flows blocked, :mod:`autoq.cpu.depthwise_neighbours`)."""

    isa: Isa
    blocked: bool
    vnni_convs: frozenset[bytes] = frozenset()
    #: weight constant -> whether its conv is in ``vnni_convs`` (each key computed once)
    _kept: dict = field(default_factory=dict, repr=False)

    def keeps_on_vnni(self, weight: relax.Expr) -> bool:
        """Whether the conv with the constant ``weight`` stays on VNNI (never when there are
        no such convs)."""
        if not self.vnni_convs:
            return False
        if weight not in self._kept:
            self._kept[weight] = weight_key(const_array(weight)) in self.vnni_convs
        return self._kept[weight]


def isa_choice(
    target: tvm.target.Target, mod: tvm.IRModule, blocked_layout: bool | None = None
) -> IsaChoice | None:
    """The :class:`IsaChoice` of lowering ``mod`` for ``target``, None when the target has no
    int8 instruction set of the kernels; ``blocked_layout`` None: the row's
    :attr:`Isa.blocked`. The convs next to depthwise ones stay on VNNI on AMX targets when
    the layout is blocked.

    >>> choice = isa_choice(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}), tvm.IRModule())
    >>> choice.isa is VNNI, choice.blocked, choice.vnni_convs
    (True, True, frozenset())
    >>> isa_choice(tvm.target.Target({"kind": "llvm"}), tvm.IRModule()) is None
    True
    """
    isa = kernel_isa(target)
    if isa is None:
        return None
    blocked = isa.blocked if blocked_layout is None else blocked_layout
    vnni = depthwise_neighbours(mod) if isa.amx and blocked else frozenset()
    return IsaChoice(isa, blocked, vnni)
