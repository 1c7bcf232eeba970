"""Activations in the blocked layout NCHW[x]c between packed int8 convs.

A packed conv kernel (:mod:`autoq.cpu.conv2d`; the channel-blocked depthwise kernel of
:mod:`autoq.cpu.depthwise` likewise) reads its activations as NCHW[x]c blocks of the
instruction set's activation dtype, shifted (VNNI: ``x + 128`` for int8 data, uint8 as it
is; AVX2: int16 ``x - zero_point``). :class:`BlockedLayout` is that form for one tensor,
chosen from the target's :class:`autoq.cpu.isa.Isa` (``x`` = its ``lanes``: 16 for VNNI, 8
for AVX2), unpadded: ``[N, ceil(C / x), H, W, x]``; the channels past ``C`` hold a stored 0,
which the zero-padded weights ignore anyway.

:func:`blocked_edges` decides, per int8 tensor of a function, whether it flows blocked: the
requantized output of a conv that stores it itself (a fused epilogue), or of a ``qnn.lut``
(one table, or one per channel) that reads a blocked tensor (VNNI only: the stored byte is
the table index), whose every
user is the data operand of a conv the kernels cover, such a lookup or the shortcut of a
residual add fused into a conv's epilogue (:mod:`autoq.cpu.residual`, which reads any
layout); the producer writes the layout and its consumers read it instead of packing NCHW (a
conv without top/left padding reads it as it is; the others only pad it). Everything else is
an edge and stays NCHW: model inputs and outputs, unfused residual ``add``s, pools, dense,
AMX convs, a tensor with any other user, or consumers that disagree on the layout (AVX2:
different zero points). On VBMI targets a lookup whose output stays NCHW still reads a
blocked input (:func:`unblocked_lut`): its conv stores the blocked layout, faster than NCHW. A depthwise conv with per-channel input zero points reads the layout
of zero point 0 and centers each channel itself (:mod:`autoq.cpu.depthwise`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from tvm import relax, te, tirx

from autoq.cpu.isa import Isa
from autoq.cpu.lut import (
    blocked_channel_lut_kernel,
    target_has_vbmi,
    transpose_picks,
    vbmi_blocked_channel_lut_kernel,
)
from autoq.ir.toolkit import bindings, const_array, dtype_of, is_call, read_counts, shape_of

__all__ = [
    "BlockedLayout",
    "blocked_edges",
    "blocked_lut",
    "layout_for",
    "lut_layout",
    "store_blocked",
    "unblocked_lut",
]

_DTYPES = ("uint8", "int8", "int16")


@dataclass(frozen=True)
class BlockedLayout:
    """``[N, ceil(C / block), H, W, block]`` of ``dtype`` holding ``value + shift`` (the
    padded channels hold ``shift``, a stored 0: the consumers' zero weights ignore them)."""

    block: int
    dtype: str
    shift: int

    def __post_init__(self):
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"BlockedLayout: block must be a power of two, got {self.block}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"BlockedLayout: dtype must be one of {_DTYPES}, got {self.dtype!r}")

    def shape(self, n: int, c: int, h: int, w: int) -> tuple[int, int, int, int, int]:
        """The blocked shape of an NCHW tensor.

        >>> BlockedLayout(16, "uint8", 128).shape(1, 20, 7, 9)
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


VNNI_INT8 = BlockedLayout(16, "uint8", 128)


def layout_for(isa: Isa, data_dtype: str, zero_point: int) -> BlockedLayout:
    """The layout a conv on ``isa`` reads ``data_dtype`` activations with ``zero_point`` in.

    >>> from autoq.cpu.isa import AVX2, VNNI
    >>> layout_for(VNNI, "int8", 3) == BlockedLayout(16, "uint8", 128)
    True
    >>> layout_for(AVX2, "uint8", 5)
    BlockedLayout(block=8, dtype='int16', shift=-5)
    """
    return BlockedLayout(isa.lanes, isa.act_dtype, isa.shift(data_dtype, zero_point))


def lut_layout(isa: Isa, data_dtype: str) -> BlockedLayout | None:
    """The blocked layout in which a ``qnn.lut`` reads ``data_dtype`` data as it is: the
    unsigned one where the stored byte is the table index (``x + 128`` for int8, VNNI), None
    when the ISA stores wider values (AVX2: int16).

    >>> from autoq.cpu.isa import AVX2, VNNI
    >>> lut_layout(VNNI, "int8") == VNNI_INT8, lut_layout(AVX2, "int8")
    (True, None)
    """
    if isa.act_dtype != "uint8":
        return None
    return BlockedLayout(isa.lanes, "uint8", isa.shift(data_dtype, 0))


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
        return tirx.if_then_else(inside, stored, tirx.const(layout.shift, layout.dtype))

    return te.compute(layout.shape(*shape), f, name="autoq_out")


def _reads(var, e) -> bool:
    """Whether ``e`` reads ``var`` as its first operand and nowhere else."""
    return e.args[0].same_as(var) and not any(a.same_as(var) for a in e.args[1:])


def blocked_edges(
    func: relax.Function,
    chains: dict,
    layout_of: Callable[[relax.Call], BlockedLayout | None],
    lut_layout: Callable[[str], BlockedLayout | None] = lambda _dtype: None,
    shortcuts: set | frozenset = frozenset(),
    elementwise: Callable | None = None,
    any_layout: Callable[[str], BlockedLayout] | None = None,
) -> dict:
    """``{var: layout}`` for the tensors of ``func`` that flow blocked.

    Candidates: the requantize variables of ``chains`` (``{var: (kernel call, epilogue)}``)
    whose kernel is a conv the kernels cover (``layout_of(conv)`` not None), ``qnn.lut`` of a
    constant table when ``lut_layout(data dtype)`` (the layout a lookup indexes directly;
    None when there is none) is not None, and (with ``any_layout``) the elementwise calls
    ``elementwise(call)`` gives the activation operand positions of
    (:func:`autoq.cpu.blocked_elementwise.blocked_operands`). A candidate flows blocked when
    every user is a conv reading it as data (the kernel of a chain, or a conv whose int32
    output goes elsewhere), a blocked lookup, a blocked elementwise call, or a shortcut
    requantize of ``shortcuts`` (a residual fused into a conv's epilogue); the convs and
    lookups must want one layout (elementwise calls and shortcuts read any: without a conv
    or lookup the tensor is stored in ``any_layout(dtype)``), and a lookup's or elementwise
    call's own inputs flow blocked; candidates are dropped until that holds for all."""
    pairs = bindings(func)
    uses = read_counts(func)
    value_of = dict(pairs)
    flexible = {}  # elementwise candidate var -> its activation operand positions
    readers: dict = {}
    for var, e in pairs:
        pos = elementwise(e) if elementwise and any_layout else None
        if pos is not None:
            flexible[var] = pos
            for a in {e.args[i] for i in pos}:
                readers.setdefault(a, []).append((var, e))
        elif var in shortcuts or is_call(e, "qnn.conv2d", "qnn.lut"):
            if isinstance(e.args[0], relax.Var):
                readers.setdefault(e.args[0], []).append((var, e))
    cand = {v for v, (kernel, _) in chains.items() if layout_of(kernel) is not None}
    cand |= set(flexible)
    for var, e in pairs:
        lut = is_call(e, "qnn.lut") and _table(e) is not None
        if lut and isinstance(e.args[0], relax.Var) and lut_layout(dtype_of(e.args[0])):
            cand.add(var)
    layouts: dict = {}
    changed = True
    while changed:
        changed, layouts = False, {}
        for var in list(cand):
            rs = readers.get(var, [])
            wanted = _wanted(var, rs, cand, layout_of, lut_layout, shortcuts, flexible)
            if not wanted and rs and any_layout is not None:
                wanted = {any_layout(dtype_of(var))}  # only readers that take any layout
            e = value_of[var]
            inputs = [e.args[i] for i in flexible.get(var, ())]
            if is_call(e, "qnn.lut"):
                inputs = [e.args[0]]
            if (
                not rs
                or len(rs) != uses[var]
                or len(wanted) != 1
                or None in wanted
                or any(a not in cand for a in inputs)
            ):
                cand.discard(var)
                changed = True
            else:
                layouts[var] = next(iter(wanted))
    return layouts


def _wanted(var, readers: list, cand: set, layout_of, lut_layout, shortcuts, flexible) -> set:
    """The layouts ``var``'s readers want (None: one cannot read it blocked); elementwise
    candidates and residual shortcuts take any (they add nothing)."""
    wanted = set()
    for user, e in readers:
        if user in flexible:
            if user not in cand:
                wanted.add(None)
        elif not _reads(var, e):
            wanted.add(None)
        elif user in shortcuts:
            continue
        elif is_call(e, "qnn.conv2d"):  # the kernel of a chain or a bare int32 conv
            wanted.add(layout_of(e))
        else:  # a lookup: blocked output, or NCHW from blocked data (unblocked_lut)
            reads = user in cand or (_table(e) is not None and target_has_vbmi())
            wanted.add(lut_layout(dtype_of(var)) if reads else None)
    return wanted


def _table(call: relax.Call) -> np.ndarray | None:
    """The constant table of a ``qnn.lut`` that can run blocked: one table, or one per
    channel of NCHW data (``axis`` 1), else None."""
    table = const_array(call.args[1])
    if table is None or table.ndim == 1:
        return table
    shape = shape_of(call.args[0])
    if table.ndim != 2 or shape is None or len(shape) != 4:
        return None
    return table if int(call.attrs["axis"]) % 4 == 1 else None


def _rows(call: relax.Call, blocks: int, layout: BlockedLayout) -> np.ndarray:
    """The table of ``call`` stored in ``layout`` (plus its shift) as one row per channel of
    ``blocks`` channel blocks (a single table repeated; the padded channels' rows a stored 0)."""
    table = (_table(call).astype(np.int32) + layout.shift).astype(layout.dtype)
    rows = np.full((blocks * layout.block, 256), layout.shift, layout.dtype)
    channels = shape_of(call)[1]
    rows[:channels] = table if table.ndim == 2 else table[None]
    return rows


def unblocked_lut(bb, call: relax.Call, data: relax.Var, layout: BlockedLayout) -> relax.Expr:
    """``qnn.lut`` of ``data`` (the blocked input of ``call``, stored unsigned: the stored
    byte is the table index) stored NCHW, the output of ``call`` (VBMI targets, blocks of
    16: :func:`autoq.cpu.lut.vbmi_blocked_channel_lut_kernel` with ``nchw``)."""
    dtype = dtype_of(call)
    rows = _rows(call, shape_of(data)[1], BlockedLayout(layout.block, dtype, 0))
    func = vbmi_blocked_channel_lut_kernel(dtype, nchw=True)
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_lut_unblocked")
    args = [data, relax.const(rows), relax.const(transpose_picks())]
    return relax.call_tir(gv, args, out_ty=relax.TensorType(shape_of(call), dtype))


def blocked_lut(bb, call: relax.Call, data: relax.Var, layout: BlockedLayout) -> relax.Expr:
    """``qnn.lut`` of ``data`` (the blocked input of ``call``, stored unsigned: the stored
    byte is the table index) with the table's values stored in ``layout``; per-channel
    tables (padded to whole blocks with a stored 0) by
    :func:`autoq.cpu.lut.vbmi_blocked_channel_lut_kernel` on targets with VBMI, else
    :func:`autoq.cpu.lut.blocked_channel_lut_kernel`."""
    table = _table(call)
    if table.ndim == 1:
        table = (table.astype(np.int32) + layout.shift).astype(layout.dtype)
        return relax.Call(call.op, [data, relax.const(table)], call.attrs)
    shape = shape_of(data)
    args = [data, relax.const(_rows(call, shape[1], layout))]
    if layout.block == 16 and target_has_vbmi():
        func = vbmi_blocked_channel_lut_kernel(layout.dtype)
        args.append(relax.const(transpose_picks()))
    else:
        func = blocked_channel_lut_kernel(shape, layout.dtype)
    gv = bb.add_func(func.without_attr("global_symbol"), "autoq_lut_blocked")
    return relax.call_tir(gv, args, out_ty=relax.TensorType(shape, layout.dtype))
