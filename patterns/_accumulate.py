"""Shared simulate/realize for layers that accumulate in int32. The kinds (conv2d, dense,
matmul) are a table, ``patterns/_kinds.py``: a new kind is one module and one row there.

Simulated form (float32 holding integers, exact while |acc| < 2**24)::

    acc = op(q_x - zp_x, q_w - zp_w)              # the original op, same attributes
    acc = acc + simulated_quantize(bias, s_x*s_w, 0, int32)        (with a bias)
    acc = acc + simulated_quantize(residual, s_x*s_w, 0, int32)    (with a residual add)
    out = simulated_dequantize(acc, s_x*s_w, 0)

Realized (canonical) form::

    acc = qnn.conv2d | qnn.dense | qnn.matmul (q_x, q_w, s_x, zp_x, s_w, zp_w)   -> int32
    acc = add(acc, int32 bias constant)
    acc = add(acc, qnn.requantize(q_residual, s_r, zp_r, s_x*s_w, 0, out_dtype=int32))
    out = qnn.dequantize(acc, s_x*s_w, 0)     # becomes qnn.requantize after propagation
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.ir.registry import Pattern
from autoq.ir.toolkit import dtype_of, shape_of


@dataclass(frozen=True)
class Kind:
    """An accumulating op kind (see ``patterns/_kinds.py`` for the table).

    ``op``: the Relax op the pattern's core matches. ``weight_axis``: the output-channel
    axis of its constant weight operand, or None when the second operand is an activation.
    ``check(g, nodes, core_value)``: kind-specific reason to reject, or None.
    ``realize(ctx, match, core_value, x) -> (int32 accumulator call, weight RealQ)``: the
    qnn op on the quantized activation ``x``. ``channel_axis(rank)``: the output's channel
    axis (where a bias and per-channel scales apply). ``dynamic``: the kind also has a
    dynamic form (run-time activation qparams, :mod:`autoq.realization.dynamic`)."""

    name: str
    op: str
    weight_axis: int | None
    check: Callable
    realize: Callable
    channel_axis: Callable[[int], int]
    dynamic: bool = False


def is_activation(g, e) -> bool:
    """A float32 tensor computed from the data (not a weight)."""
    return isinstance(e, relax.Var) and g.is_data_dependent(e) and dtype_of(e) == "float32"


def _check(kind: Kind, bias: bool, residual: bool):
    def check(g, nodes):
        core = g.value.get(nodes["core"])
        if core is None or dtype_of(nodes["core"]) != "float32":
            return "not a float32 op"
        if not is_activation(g, nodes["data"]):
            return "data is not a float32 activation"
        out_shape = shape_of(nodes["core"])
        if out_shape is None:
            return "output shape is not static"
        reason = kind.check(g, nodes, core)
        if reason is None and bias:
            reason = _check_bias(g, nodes, kind, out_shape)
        if reason is None and residual:
            r, own = nodes["residual"], [nodes["core"], nodes.get("biased")]
            if not is_activation(g, r) or shape_of(r) != shape_of(
                nodes.get("biased", nodes["core"])
            ):
                reason = "residual is not a float32 activation of the output's shape"
            elif any(r.same_as(v) for v in own if v is not None):
                reason = "the residual is the layer's own output (y + y)"
        return reason

    return check


def _check_bias(g, nodes, kind: Kind, out_shape) -> str | None:
    ref = g.weight_of(nodes["bias"])
    if ref is None or ref.array.dtype != np.float32 or kind.weight_axis is None:
        return "bias is not a constant float32 tensor"
    ch_axis = kind.channel_axis(len(out_shape))
    b = ref.array.shape
    # per-channel bias: every dim 1 except the channel dim (aligned to the output)
    if ref.array.size != out_shape[ch_axis] or len(b) > len(out_shape):
        return "bias is not per output channel"
    aligned = (1,) * (len(out_shape) - len(b)) + tuple(b)
    if any(d != 1 for i, d in enumerate(aligned) if i != ch_axis):
        return "bias is not per output channel"
    return None


def _build(kind: Kind, bias: bool, residual: bool):
    op = kind.op
    orders = ((0, 1), (1, 0))

    def build():
        # one alternative per operand order of each add: DPL's "|" would stop at the first
        # structural match, before the check could reject it and try the other order
        alts = []
        for border in orders if bias else [None]:
            for rorder in orders if residual else [None]:
                data, weight = wildcard(), wildcard()
                core = is_op(op)(data, weight)
                named = {"data": data, "weight": weight, "core": core}
                root = core
                if bias:
                    b = wildcard()
                    pair = (root, b)
                    root = is_op("relax.add")(*[pair[i] for i in border])
                    named["bias"], named["biased"] = b, root
                if residual:
                    r = wildcard()
                    pair = (root, r)
                    root = is_op("relax.add")(*[pair[i] for i in rorder])
                    named["residual"] = r
                alts.append((root, named))
        return alts

    return build


def _frame(kind: Kind, ctx, m):
    """(core op value, output shape, channel axis, quantized input) of a match."""
    out_shape = list(shape_of(m.root))
    x = ctx.activation(m["data"])
    return ctx.g.value[m["core"]], out_shape, kind.channel_axis(len(out_shape)), x


def _bias_and_residual(ctx, m, acc, s_acc, out_shape, ch_axis, residual_on_acc_grid):
    """``acc`` + the int32 bias + the residual moved onto the accumulator's grid."""
    if "bias" in m.nodes:
        acc = ctx.emit(relax.op.add(acc, ctx.bias(m["bias"], s_acc, out_shape, ch_axis)))
    if "residual" in m.nodes:
        r = ctx.emit(residual_on_acc_grid(ctx.activation(m["residual"])))
        acc = ctx.emit(relax.op.add(acc, r))
    return acc


def _simulate(kind: Kind):
    def simulate(ctx, m):
        core, out_shape, ch_axis, x = _frame(kind, ctx, m)
        if kind.weight_axis is None:
            w = ctx.activation(m["weight"])
        else:
            w = ctx.weight(m["weight"], kind.weight_axis)
        acc = ctx.emit(relax.Call(core.op, [x.centered, w.centered], core.attrs))
        s_acc = ctx.emit(relax.op.multiply(x.scale, w.scale))
        zeros = relax.const(np.zeros(shape_of(s_acc), np.int32))

        def residual(r):
            return qnn.simulated_quantize(r.real, s_acc, zeros, axis=ch_axis, dtype="int32")

        acc = _bias_and_residual(ctx, m, acc, s_acc, out_shape, ch_axis, residual)
        return qnn.simulated_dequantize(acc, s_acc, zeros, axis=ch_axis)

    return simulate


def _realize(kind: Kind):
    def realize(ctx, m):
        core, out_shape, ch_axis, x = _frame(kind, ctx, m)
        acc, w = kind.realize(ctx, m, core, x)
        acc = ctx.emit(acc)
        s_acc = (x.scale * w.scale).astype(np.float32)
        zeros = relax.const(np.zeros(s_acc.shape, np.int32))

        def residual(r):
            return qnn.requantize(
                r.q, r.scale_c, r.zero_point_c, relax.const(s_acc), zeros,
                axis=ch_axis, out_dtype="int32", rounding=ctx.rounding,
            )  # fmt: skip

        acc = _bias_and_residual(ctx, m, acc, s_acc, out_shape, ch_axis, residual)
        return qnn.dequantize(acc, relax.const(s_acc), zeros, axis=ch_axis)

    return realize


def _float_tail(ctx, m, acc, s_acc) -> relax.Expr:
    """``acc * s_acc`` (float32) plus the float32 bias and residual: how a dynamic layer's
    result leaves integer space (realized and simulated alike)."""
    y = relax.op.multiply(acc, s_acc)
    for part in ("bias", "residual"):
        if part in m.nodes:
            y = relax.op.add(ctx.emit(y), ctx.value(m[part]))
    return y


def _dynamic(kind: Kind):
    """Dynamic form: ``float32(acc) * (s_x * s_w)`` with the run-time ``s_x`` of
    ``qnn.dynamic_quantize``, then the bias and the residual added in float32."""

    def dynamic(ctx, m):
        x = ctx.dynamic_activation(m["data"])
        acc, w = kind.realize(ctx, m, ctx.g.value[m["core"]], x)
        acc = ctx.emit(acc)
        s_acc = ctx.emit(relax.op.multiply(x.scale_c, w.scale_c))
        return _float_tail(ctx, m, relax.op.astype(acc, "float32"), s_acc)

    return dynamic


def _simulate_dynamic(kind: Kind):
    """Simulated dynamic form (:mod:`autoq.rules.hybrid`): the core op on the run-time integers
    (as float32) and the simulated weight integers, then :func:`_float_tail`."""

    def simulate(ctx, m):
        core = ctx.g.value[m["core"]]
        x = ctx.dynamic_activation(m["data"])
        w = ctx.weight(m["weight"], kind.weight_axis)
        acc = ctx.emit(relax.Call(core.op, [x.centered, w.centered], core.attrs))
        s_acc = ctx.emit(relax.op.multiply(x.scale, w.scale))
        return _float_tail(ctx, m, acc, s_acc)

    return simulate


def make(
    name: str, kind: Kind, bias: bool = False, residual: bool = False, doc: str = ""
) -> Pattern:
    """The pattern ``name``: ``kind`` (a row of ``patterns._kinds.KINDS``) with an optional
    bias and residual add."""
    return Pattern(
        name=name,
        priority=1 + int(bias) + int(residual),
        build=_build(kind, bias, residual),
        check=_check(kind, bias, residual),
        simulate=_simulate(kind),
        realize=_realize(kind),
        weight=None if kind.weight_axis is None else "weight",
        anchor="core",
        doc=doc,
        dynamic=_dynamic(kind) if kind.dynamic else None,
        simulate_dynamic=_simulate_dynamic(kind) if kind.dynamic else None,
    )


__all__ = ["Kind", "is_activation", "make"]
