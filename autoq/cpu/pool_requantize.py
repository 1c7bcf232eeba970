"""Requantize after max pools and copies, not before them: exact rewrites of the realized graph.

A requantize with positive scales (every rounding mode: ``round((q - z1) * s1 / s2) + z2``
clipped, or its integer multiplier form) maps each value by a monotone non-decreasing
function ``f``. Such an ``f`` commutes with a max pool (``max f(x) = f(max x)``) and with any
op that only copies values (a pad repeating the edge). ResNet's stem, realized as

    qnn.dequantize -> replicate pad (a call_tir, fp32) -> qnn.quantize -> max_pool2d

(the pad's output has its own grid, so a dequantize / quantize pair stays around the pad),
becomes ``replicate pad (int8) -> max_pool2d -> qnn.requantize``, and the pad folds into the
pool (:data:`FOLDS`: padded with the dtype's minimum instead, where every window still reads
the edge value each of its copies repeats): one int8 pool, the requantize on its output, a
quarter of the values for a 3x3 / 2 pool. The values are unchanged, bit for bit.

:data:`MOVES` has one row per op a requantize (or a ``qnn.dequantize -> qnn.quantize`` pair,
which is a float requantize) moves below; :func:`requantize_after_pools` applies them and
the folds.

>>> sorted(MOVES)
['relax.call_tir', 'relax.nn.max_pool2d']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, tirx

from autoq import qnn
from autoq.ir import toolkit as tk
from autoq.ir.toolkit import BindingWriter, remap_expr

__all__ = ["FOLDS", "MOVES", "Move", "edge_pad_widths", "requantize_after_pools"]

CODES = ("int8", "uint8")  # the dtypes the moved ops run on


@dataclass(frozen=True)
class Move:
    """How an elementwise monotone map moves below one op: ``integer(mod, call, x)`` is the op
    applied to the codes ``x`` (the map's input), or None where the op does not commute with
    the map exactly. ``over``: what the map before the op is, ``"requantize"`` (a
    ``qnn.requantize``) or ``"pair"`` (``qnn.dequantize`` in, ``qnn.quantize`` out: the op
    runs on floats between them)."""

    integer: Callable
    over: str
    doc: str

    def __post_init__(self):
        if self.over not in ("requantize", "pair"):
            raise ValueError(f"Move.over must be requantize or pair, got {self.over!r}")


def _max_pool(_mod, call, x):
    a = call.attrs
    if any(int(p) != 0 for p in a.padding) or str(a.layout) != "NCHW":
        return None  # a padded value is the dtype's minimum, which f does not keep
    return tvm.ir.Call(call.op, [x], call.attrs)


_BINARY = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "Min": min,
    "Max": max,
    "FloorDiv": lambda a, b: a // b,
    "FloorMod": lambda a, b: a % b,
}


def _index_value(expr, var, value: int) -> int | None:
    """The integer index expression ``expr`` at ``var = value``; None if it reads anything
    else (another variable, a load, a call)."""
    kind = type(expr).__name__
    if kind == "IntImm":
        return int(expr.value)
    if kind == "Var":
        return value if expr.same_as(var) else None
    if kind == "Cast":
        return _index_value(expr.value, var, value)
    if kind in _BINARY:
        a, b = _index_value(expr.a, var, value), _index_value(expr.b, var, value)
        if a is None or b is None or (kind.startswith("Floor") and b == 0):
            return None
        return _BINARY[kind](a, b)
    return None


def _only_store(stmt):
    """The one ``BufferStore`` of a loop nest of blocks without predicates, inits or
    allocations; None for any other body."""
    while True:
        kind = type(stmt).__name__
        if kind == "BufferStore":
            return stmt
        if kind == "For":
            stmt = stmt.body
        elif kind == "SBlockRealize":
            if not (isinstance(stmt.predicate, tirx.IntImm) and stmt.predicate.value == 1):
                return None
            stmt = stmt.block
        elif kind == "SBlock":
            if stmt.init is not None or stmt.alloc_buffers or stmt.match_buffers:
                return None
            stmt = stmt.body
        else:
            return None


def edge_pad_widths(func) -> list[tuple[int, int]] | None:
    """``(before, after)`` per axis when the PrimFunc ``func`` (input and output buffers) is
    an edge-repeating pad: its body one store ``out[i_0, ..., i_n] = in[g_0(i_0), ...,
    g_n(i_n)]`` (loops and blocks around it, nothing else), each ``g_k`` a function of its
    own output index alone equal to ``numpy.pad(arange(in_k), (before, after), "edge")``;
    else None."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 2:
        return None
    src, dst = func.params  # buffers
    store = _only_store(func.body)
    if store is None or not store.buffer.same_as(dst):
        return None
    load = store.value
    source = getattr(load, "source", getattr(load, "buffer", None))
    if source is None or not source.same_as(src) or len(load.indices) != len(store.indices):
        return None
    out_vars = list(store.indices)
    if not all(isinstance(v, tirx.Var) for v in out_vars):
        return None
    widths = []
    for k, (index, var) in enumerate(zip(load.indices, out_vars, strict=True)):
        n_in, n_out = int(src.shape[k]), int(dst.shape[k])
        gather = [_index_value(index, var, i) for i in range(n_out)]
        if n_out < n_in or any(g is None for g in gather):
            return None  # (None also when g_k reads another axis' index)
        found = None
        for before in range(n_out - n_in + 1):
            want = np.pad(np.arange(n_in), (before, n_out - n_in - before), mode="edge")
            if np.array_equal(want, gather):
                found = (before, n_out - n_in - before)
                break
        if found is None:
            return None
        widths.append(found)
    return widths


def _copy(mod, call, x):
    gv = call.args[0]
    if not isinstance(gv, tvm.ir.GlobalVar) or len(call.args[1].fields) != 1:
        return None
    widths = edge_pad_widths(mod[gv]) if gv in mod.get_global_vars() else None
    if widths is None:
        return None
    return relax.op.nn.pad(x, [w for pair in widths for w in pair], "replicate")


#: op -> how a monotone requantize moves below it
MOVES: dict[str, Move] = {
    "relax.nn.max_pool2d": Move(
        _max_pool, "requantize", "max f(x) = f(max x); unpadded NCHW pools only"
    ),
    "relax.call_tir": Move(
        _copy, "pair", "an edge-repeating pad kernel (edge_pad_widths): relax.nn.pad on codes"
    ),
}


def _edge_pad_into_pool(pool, pad):
    """``max_pool2d(pad(q, replicate))`` as one max pool padded with the dtype's minimum, or
    None: exact when every window reads a real value next to the copies it reads (a window
    over copies alone would see the minimum instead)."""
    a = pool.attrs
    out = tk.shape_of(pool)
    if str(pad.attrs.pad_mode) != "replicate" or str(a.layout) != "NCHW" or out is None:
        return None
    width = [int(v) for v in pad.attrs.pad_width]
    if any(width[:4]) or any(int(d) != 1 for d in a.dilation):
        return None
    size = tk.shape_of(pad.args[0])
    padding = [int(v) for v in a.padding]  # top, left, bottom, right
    for k in range(2):
        before, after = width[4 + 2 * k], width[5 + 2 * k]
        win, step, n_in, n_out = int(a.pool_size[k]), int(a.strides[k]), size[2 + k], out[2 + k]
        first_end = win - 1 - padding[k]
        last_start = (n_out - 1) * step - padding[k]
        if first_end < before or last_start > before + n_in - 1:
            return None
        padding[k] += before
        padding[2 + k] += after
    return relax.op.nn.max_pool2d(
        pad.args[0], [int(v) for v in a.pool_size], [int(v) for v in a.strides], padding,
        [1, 1], bool(a.ceil_mode), bool(a.count_include_pad), "NCHW", "NCHW",
    )  # fmt: skip


#: op -> how an edge pad before it folds into it (on int8 codes)
FOLDS: dict[str, Callable] = {"relax.nn.max_pool2d": _edge_pad_into_pool}


def _scalar(e) -> bool:
    v = tk.const_array(e)
    return v is not None and v.ndim == 0


def _monotone(req) -> bool:
    """A per-tensor (or per-channel, axis 1) requantize with positive constant scales."""
    _, s1, z1, s2, z2 = req.args[:5]
    scales = [tk.const_array(s) for s in (s1, s2)]
    if any(s is None or not np.all(s > 0) for s in scales) or not (_scalar(z1) and _scalar(z2)):
        return False
    return all(s.ndim == 0 for s in scales) or int(req.attrs["axis"]) == 1


class _Pass:
    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        self.mod = mod
        self.value = dict(tk.bindings(func))
        self.uses = tk.read_counts(func)

    def once(self, var) -> relax.Expr | None:
        """The value of the single-use variable ``var``, or None."""
        return self.value.get(var) if self.uses[var] == 1 else None

    def rewrite(self, value):
        fold = FOLDS.get(tk.op_name(value))
        pad = self.once(value.args[0]) if fold is not None else None
        if tk.is_call(pad, "relax.nn.pad") and tk.dtype_of(pad) in CODES:
            folded = fold(value, pad)
            if folded is not None:
                return folded, None
        rule = MOVES.get(tk.op_name(value))
        if rule is None or rule.over != "requantize" or not value.args:
            return self._pair(value)
        req = self.once(value.args[0])
        if not tk.is_call(req, "qnn.requantize") or not _monotone(req):
            return None
        if tk.dtype_of(req.args[0]) not in CODES:
            return None  # an accumulator's requantize stays in its kernel's epilogue
        moved = rule.integer(self.mod, value, req.args[0])
        if moved is None:
            return None
        return moved, lambda y: tvm.ir.Call(req.op, [y, *req.args[1:]], req.attrs)

    def _pair(self, value):
        """``qnn.quantize(op(qnn.dequantize(q)))`` (per tensor) -> ``requantize(op(q))``."""
        if not tk.is_call(value, "qnn.quantize") or not _scalar(value.args[1]):
            return None
        inner = self.once(value.args[0])
        rule = MOVES.get(tk.op_name(inner))
        if rule is None or rule.over != "pair":
            return None
        deq = self.once(inner.args[1].fields[0]) if tk.is_call(inner, "relax.call_tir") else None
        if not tk.is_call(deq, "qnn.dequantize") or not (
            _scalar(deq.args[1]) and _scalar(deq.args[2])
        ):
            return None
        q = deq.args[0]
        if tk.dtype_of(q) not in CODES or not _positive(deq.args[1], value.args[1]):
            return None
        moved = rule.integer(self.mod, inner, q)
        if moved is None:
            return None
        _, s1, z1 = deq.args
        _, s2, z2 = value.args
        out_dtype = str(value.attrs["out_dtype"])
        return moved, lambda y: qnn.requantize(y, s1, z1, s2, z2, out_dtype=out_dtype)


def _positive(*scales) -> bool:
    return all(float(tk.const_array(s)) > 0 for s in scales)


def requantize_after_pools(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with the requantizes of :data:`MOVES` moved below their ops, repeatedly (a
    pad's pair becomes a requantize, which then moves below the max pool after it)."""
    if not any(gv.name_hint == "main" for gv in mod.get_global_vars()):
        return mod
    for _ in range(1000):  # one move per round: the use counts are the round's
        func = mod["main"]
        p = _Pass(mod, func)
        w = BindingWriter()
        vmap: dict = {}
        changed = False
        for var, value in tk.bindings(func):
            out = p.rewrite(value) if not changed else None
            if out is None:
                vmap[var] = w.emit(remap_expr(value, vmap), var.name)
                continue
            moved, after = out
            if after is None:
                vmap[var] = w.emit(remap_expr(moved, vmap), var.name)
            else:
                y = w.emit(remap_expr(moved, vmap), var.name + "_codes")
                vmap[var] = w.emit(remap_expr(after(y), vmap), var.name)
            changed = True
        if not changed:
            w.abandon()
            return mod
        new = w.finish(func.params, remap_expr(func.body.body, vmap), func.attrs)
        mod = tk.with_main(mod, relax.analysis.remove_all_unused(new))
    return mod
