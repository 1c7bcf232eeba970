"""Shared simulate/realize for layers that accumulate in int32: conv2d, dense, matmul.

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

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from autoq import qnn
from autoq.registry import Pattern
from autoq.toolkit import dtype_of, op_name, shape_of

#: kind -> (Relax op, weight output-channel axis, whether the rhs is a weight)
KINDS = {
    "conv2d": ("relax.nn.conv2d", 0, True),
    "dense": ("relax.matmul", 1, True),
    "matmul": ("relax.matmul", None, False),
}


def _ints(v) -> list[int]:
    return [int(x) for x in v]


def _is_act(g, e) -> bool:
    return isinstance(e, relax.Var) and g.is_data_dependent(e) and dtype_of(e) == "float32"


def _out_channels(kind, g, nodes) -> int | None:
    shape = shape_of(nodes["core"])
    if shape is None:
        return None
    return shape[1] if kind == "conv2d" else shape[-1]


def _check(kind: str, bias: bool, residual: bool):
    def check(g, nodes):
        core = g.value.get(nodes["core"])
        if core is None or dtype_of(nodes["core"]) != "float32":
            return "not a float32 op"
        if not _is_act(g, nodes["data"]):
            return "data is not a float32 activation"
        out_shape = shape_of(nodes["core"])
        if out_shape is None:
            return "output shape is not static"
        if kind == "conv2d":
            a = core.attrs
            if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCHW", "OIHW", "NCHW"):
                return "only NCHW/OIHW conv2d"
            ref = g.weight_of(nodes["weight"])
            if ref is None or ref.array.ndim != 4 or ref.array.dtype != np.float32:
                return "weight is not a constant float32 OIHW tensor"
        elif kind == "dense":
            ref = g.weight_of(nodes["weight"])
            if ref is None or ref.array.ndim != 2 or ref.array.dtype != np.float32:
                return "rhs is not a constant 2-D float32 weight"
            if len(shape_of(nodes["data"]) or ()) < 1:
                return "data has no static shape"
        else:
            if not _is_act(g, nodes["weight"]):
                return "rhs is not an activation (use dense for weights)"
            if len(shape_of(nodes["data"]) or ()) < 2 or len(shape_of(nodes["weight"]) or ()) < 2:
                return "matmul operands must have rank >= 2"
        if bias:
            ref = g.weight_of(nodes["bias"])
            ch = _out_channels(kind, g, nodes)
            if ref is None or ref.array.dtype != np.float32 or kind == "matmul":
                return "bias is not a constant float32 tensor"
            b = ref.array.shape
            ch_axis = 1 if kind == "conv2d" else len(out_shape) - 1
            # per-channel bias: every dim 1 except the channel dim (aligned to the output)
            if ref.array.size != ch or len(b) > len(out_shape):
                return "bias is not per output channel"
            aligned = (1,) * (len(out_shape) - len(b)) + tuple(b)
            if any(d != 1 for i, d in enumerate(aligned) if i != ch_axis):
                return "bias is not per output channel"
        if residual:
            r = nodes["residual"]
            if not _is_act(g, r) or shape_of(r) != shape_of(nodes.get("biased", nodes["core"])):
                return "residual is not a float32 activation of the output's shape"
        return None

    return check


def _build(kind: str, bias: bool, residual: bool):
    op = KINDS[kind][0]
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


def _channel_axis(kind, out_shape):
    return 1 if kind == "conv2d" else len(out_shape) - 1


def _simulate(kind: str):
    w_axis = KINDS[kind][1]

    def simulate(ctx, m):
        g = ctx.g
        core = g.value[m["core"]]
        out_shape = list(shape_of(m.root))
        ch_axis = _channel_axis(kind, out_shape)
        x = ctx.activation(m["data"])
        w = ctx.weight(m["weight"], w_axis) if KINDS[kind][2] else ctx.activation(m["weight"])
        acc = ctx.emit(relax.Call(core.op, [x.centered, w.centered], core.attrs))
        s_acc = ctx.emit(relax.op.multiply(x.scale, w.scale))
        zeros = relax.const(np.zeros(shape_of(s_acc), np.int32))
        if "bias" in m.nodes:
            acc = ctx.emit(relax.op.add(acc, ctx.bias(m["bias"], s_acc, out_shape, ch_axis)))
        if "residual" in m.nodes:
            r = ctx.activation(m["residual"])
            ra = ctx.emit(qnn.simulated_quantize(r.real, s_acc, zeros, axis=ch_axis, dtype="int32"))
            acc = ctx.emit(relax.op.add(acc, ra))
        return qnn.simulated_dequantize(acc, s_acc, zeros, axis=ch_axis)

    return simulate


def _realize(kind: str):
    w_axis = KINDS[kind][1]

    def realize(ctx, m):
        g = ctx.g
        core = g.value[m["core"]]
        out_shape = list(shape_of(m.root))
        ch_axis = _channel_axis(kind, out_shape)
        x = ctx.activation(m["data"])
        if kind == "conv2d":
            w = ctx.weight(m["weight"], w_axis)
            a = core.attrs
            acc = qnn.conv2d(
                x.q, w.q, x.scale_c, x.zero_point_c, w.scale_c, w.zero_point_c,
                strides=_ints(a.strides), padding=_ints(a.padding), dilation=_ints(a.dilation),
                groups=int(a.groups),
            )  # fmt: skip
        elif kind == "dense":
            w = ctx.weight(m["weight"], w_axis, transpose=(1, 0))
            acc = qnn.dense(x.q, w.q, x.scale_c, x.zero_point_c, w.scale_c, w.zero_point_c)
        else:
            w = ctx.activation(m["weight"])
            acc = qnn.matmul(x.q, w.q, x.scale_c, x.zero_point_c, w.scale_c, w.zero_point_c)
        acc = ctx.emit(acc)
        s_acc = (x.scale * w.scale).astype(np.float32)
        zeros = np.zeros(s_acc.shape, np.int32)
        if "bias" in m.nodes:
            acc = ctx.emit(relax.op.add(acc, ctx.bias(m["bias"], s_acc, out_shape, ch_axis)))
        if "residual" in m.nodes:
            r = ctx.activation(m["residual"])
            ra = ctx.emit(
                qnn.requantize(
                    r.q, r.scale_c, r.zero_point_c, relax.const(s_acc), relax.const(zeros),
                    axis=ch_axis, out_dtype="int32", rounding=ctx.rounding,
                )
            )  # fmt: skip
            acc = ctx.emit(relax.op.add(acc, ra))
        return qnn.dequantize(acc, relax.const(s_acc), relax.const(zeros), axis=ch_axis)

    return realize


def make(
    name: str, kind: str, bias: bool = False, residual: bool = False, doc: str = ""
) -> Pattern:
    """The pattern ``name``: ``kind`` (conv2d, dense, matmul) with optional bias and residual."""
    priority = 1 + int(bias) + int(residual)
    return Pattern(
        name=name,
        priority=priority,
        build=_build(kind, bias, residual),
        check=_check(kind, bias, residual),
        simulate=_simulate(kind),
        realize=_realize(kind),
        weight="weight" if KINDS[kind][2] else None,
        anchor="core",
        doc=doc,
    )


__all__ = ["KINDS", "make", "op_name"]
