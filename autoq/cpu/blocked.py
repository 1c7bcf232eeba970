"""Activations in the blocked layout NCHW[x]c between packed int8 convs.

A packed conv kernel (:mod:`autoq.cpu.conv2d`; the channel-blocked depthwise kernel of
:mod:`autoq.cpu.depthwise` likewise) reads its activations as NCHW[x]c blocks of
the instruction set's activation dtype, shifted (VNNI: ``x + 128`` for int8 data, uint8 as
it is; AVX2: int16 ``x - zero_point``). :class:`BlockedLayout` is that form for one tensor,
chosen from the target's :class:`autoq.cpu.isa.Isa` (``x`` = its ``lanes``: 16 for VNNI, 8
for AVX2), unpadded: ``[N, ceil(C / x), H, W, x]``, the channels past ``C`` hold ``pad``
(the shifted zero point, which the zero-padded weights ignore anyway).

:func:`blocked_edges` decides, per int8 tensor of a function, whether it flows blocked: the
requantized output of a conv that stores it itself (a fused epilogue) whose every user is the
data operand of a conv the kernels cover; the producer's epilogue then writes the layout and
its consumers read it instead of packing NCHW (a conv without top/left padding reads it as
it is; the others only pad it). Everything else is an edge and stays NCHW: model inputs and
outputs, residual ``add``s, pools, dense, row-kernel (wide 3x3) depthwise and AMX convs, a
tensor with any non-conv user, or convs that disagree on the zero point.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from tvm import relax, te, tirx

from ..toolkit import bindings, free_vars, is_call
from .isa import Isa

__all__ = ["BlockedLayout", "blocked_edges", "layout_for", "store_blocked"]

_DTYPES = ("uint8", "int8", "int16")


@dataclass(frozen=True)
class BlockedLayout:
    """``[N, ceil(C / block), H, W, block]`` of ``dtype`` holding ``value + shift``;
    ``pad``: what the padded channels hold."""

    block: int
    dtype: str
    shift: int
    pad: int

    def __post_init__(self):
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"BlockedLayout: block must be a power of two, got {self.block}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"BlockedLayout: dtype must be one of {_DTYPES}, got {self.dtype!r}")

    def shape(self, n: int, c: int, h: int, w: int) -> tuple[int, int, int, int, int]:
        """The blocked shape of an NCHW tensor.

        >>> BlockedLayout(16, "uint8", 128, 125).shape(1, 20, 7, 9)
        (1, 2, 7, 9, 16)
        """
        return (n, -(-c // self.block), h, w, self.block)

    def to_json(self) -> str:
        """The layout as JSON (:meth:`from_json` reads it back).

        >>> BlockedLayout.from_json(VNNI_INT8.to_json()) == VNNI_INT8
        True
        """
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BlockedLayout:
        return cls(**json.loads(text))


VNNI_INT8 = BlockedLayout(16, "uint8", 128, 128)


def layout_for(isa: Isa, data_dtype: str, zero_point: int) -> BlockedLayout:
    """The layout a conv on ``isa`` reads ``data_dtype`` activations with ``zero_point`` in.

    >>> from autoq.cpu.isa import AVX2, VNNI
    >>> layout_for(VNNI, "int8", 3) == BlockedLayout(16, "uint8", 128, 131)
    True
    >>> layout_for(AVX2, "uint8", 5)
    BlockedLayout(block=8, dtype='int16', shift=-5, pad=0)
    """
    shift = isa.shift(data_dtype, zero_point)
    return BlockedLayout(isa.lanes, isa.act_dtype, shift, zero_point + shift)


def store_blocked(shape, channels: int, value, layout: BlockedLayout, inputs: list, epilogue):
    """The kernel's ``autoq_out`` stage storing ``epilogue(value(n, channel, y, x))`` in
    ``layout`` (``shape``: the NCHW output); the epilogue table is appended to ``inputs``."""
    table = te.placeholder(epilogue.table().shape, "int32", name="epilogue")
    inputs.append(table)
    b = layout.block

    def f(n, c, y, x, ci):
        ch = c * b + ci
        if channels % b:  # keep the padded channels' (discarded) reads inside the table
            ch = tirx.min(ch, channels - 1)
        q = epilogue.value(value(n, ch, y, x), ch, lambda r, k: table[r, k])
        stored = (q.astype("int32") + layout.shift).astype(layout.dtype)
        if channels % b == 0:
            return stored
        inside = c * b + ci < channels
        return tirx.if_then_else(inside, stored, tirx.const(layout.pad, layout.dtype))

    return te.compute(layout.shape(*shape), f, name="autoq_out")


def _users(pairs, body) -> Counter:
    uses: Counter = Counter()
    for _, e in pairs:
        uses.update(free_vars(e))
    uses.update(free_vars(body))
    return uses


def blocked_edges(
    func: relax.Function,
    chains: dict,
    kernels: dict,
    layout_of: Callable[[relax.Call], BlockedLayout | None],
) -> dict:
    """``{requantize var: layout}`` for the variables of ``chains`` (``{var: (kernel call,
    epilogue)}``) that flow blocked: produced by a conv (``layout_of(conv)`` not None) and
    read only as the data of convs that are the kernels (``kernels``: the kernel variables
    of the chains) of other chains and all take the same layout (``layout_of``)."""
    pairs = bindings(func)
    uses = _users(pairs, func.body.body)
    readers: dict = {}
    for var, e in pairs:
        if var in kernels and is_call(e, "qnn.conv2d") and isinstance(e.args[0], relax.Var):
            readers.setdefault(e.args[0], []).append(e)
    out = {}
    for var, (kernel, _epilogue) in chains.items():
        convs = readers.get(var, [])
        if not convs or uses[var] != len(convs) or layout_of(kernel) is None:
            continue
        if any(c.args[0].same_as(a) for c in convs for a in c.args[1:]):
            continue  # also read as another operand of the conv
        layouts = {layout_of(c) for c in convs}
        if len(layouts) == 1 and None not in layouts:
            out[var] = layouts.pop()
    return out
