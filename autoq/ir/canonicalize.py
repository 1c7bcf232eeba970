"""Canonicalization: one form per operation, whatever frontend wrote the model.

Frontends decompose the same layer differently (measured on TVM 0.27's importers):

==============  ===============================================  ==========================================
operation        ``from_torch`` (torch.export)                   ``from_onnx`` (torch.onnx export, opset 13)
==============  ===============================================  ==========================================
hardswish        ``(x * clip(clip(x + 3, 0, inf), -inf, 6)) / 6``   ``x * clip(x * (1/6) + 0.5, 0, 1)``
hardsigmoid      ``clip(clip(x + 3, 0, inf), -inf, 6) / 6``         ``clip(x * (1/6) + 0.5, 0, 1)``
silu             ``x * sigmoid(x)``                                 ``x * sigmoid(x)``
gelu (erf)       ``nn.gelu``                                        ``(x * (erf(x / sqrt 2) + 1)) * 0.5``
gelu (tanh)      ``nn.gelu_tanh``                                   ``0.5 * (x * (1 + tanh(c * (x + a x^3))))``
layer norm       ``nn.layer_norm``                                  mean / subtract / power / mean / add / sqrt / divide / multiply / add
relu6            ``clip(x, 0, 6)``                                  ``clip(x, 0, 6)`` (nn.relu6 builds a clip)
conv2d           ``out_dtype="float32"``                            no ``out_dtype`` (None)
layer norm       ``axes=[-1]``, epsilon 1e-5 (double)               positive axes, float32 epsilon
leaky relu       alpha as a double                                  alpha as a float32
==============  ===============================================  ==========================================

:func:`canonicalize` rewrites each of them into ONE form before matching: ``autoq.hardswish``
and ``autoq.hardsigmoid`` (fp32 ops registered here, legalized to their definition),
``nn.silu``, ``nn.gelu``, ``nn.gelu_tanh``, ``nn.layer_norm`` (positive axes, float32 epsilon),
a single ``clip`` for a chain of clips (``relu6`` included), float convolutions without an
explicit ``out_dtype``, float32-valued attributes (leaky relu's alpha), attention masks
of ``finfo.min`` (-> -1e4, :mod:`autoq.ir.attention_mask`) and a division by a constant as a
multiplication by its float32 reciprocal (``x / c`` -> ``x * (1/c)``, within 1.5 ulp; so
``x / c`` is quantized like ``x * c``, after the rules that read a ``/ 6`` or ``/ sqrt 2``), and
a residual added after the reshape of a dense output (``reshape(x @ W + b) + r``, a
transformer's FFN output) before it (``reshape(x @ W + b + reshape(r))``: the dense layer's
residual, added in float by a dynamic dense layer instead of an 8-bit ``add``). A
rule only fires when its constants are the operation's (to 1e-6 relative): ``x * clip(x * 0.2
+ 0.5, 0, 1)`` (ONNX HardSigmoid's default alpha) is left alone. The rules are a table
(:data:`RULES`); adding a decomposition is one row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, te
from tvm.ir import _ffi_api as _ir_ffi
from tvm.relax.dpl import (
    ConstantPattern,
    DFPattern,
    WildcardPattern,
    is_const,
    is_op,
    rewrite_call,
    wildcard,
)
from tvm.relax.transform.legalize_ops.common import register_legalize
from tvm_ffi import structural_equal

from autoq.ir.attention_mask import mask_multiply, mask_where, rewrite_mask_constant
from autoq.ir.prepare import rebind
from autoq.ir.toolkit import bindings, const_array, free_vars, op_name, shape_of, with_main

__all__ = [
    "CANONICAL_OPS",
    "RULES",
    "Rule",
    "canonicalize",
    "hard_te",
    "hardsigmoid",
    "hardswish",
]

# ------------------------------------------------------------------- canonical fp32 ops

#: the fp32 ops canonicalization introduces: name -> the function they compute
CANONICAL_OPS: dict[str, str] = {
    "autoq.hardswish": "x * clip(x + 3, 0, 6) / 6",
    "autoq.hardsigmoid": "clip(x + 3, 0, 6) / 6",
}


def hard_te(x, times_x: bool):
    """The TE kernel of ``autoq.hardswish`` (``times_x``) or ``autoq.hardsigmoid`` on ``x``."""

    def f(*i):
        v = x(*i)
        h = te.max(te.min(v + tvm.tirx.const(3.0, x.dtype), 6.0), 0.0)
        h = h / tvm.tirx.const(6.0, x.dtype)
        return v * h if times_x else h

    return te.compute(x.shape, f, name="hardswish" if times_x else "hardsigmoid")


def _register_unary(name: str, times_x: bool) -> None:
    try:
        op = tvm.ir.Op.get(name)
    except Exception:
        _ir_ffi.RegisterOp(name, CANONICAL_OPS[name])
        op = tvm.ir.Op.get(name)
    if op.get_attr("FInferType") is None:
        op.set_attr("FInferType", lambda call, ctx: call.args[0].ty)
        op.set_attr("FPurity", True)
        register_legalize(name, lambda bb, call: bb.call_te(hard_te, call.args[0], times_x))


_register_unary("autoq.hardswish", True)
_register_unary("autoq.hardsigmoid", False)


def hardswish(x: relax.Expr) -> relax.Call:
    """``x * clip(x + 3, 0, 6) / 6`` as one op (float32)."""
    return relax.Call(tvm.ir.Op.get("autoq.hardswish"), [x])


def hardsigmoid(x: relax.Expr) -> relax.Call:
    """``clip(x + 3, 0, 6) / 6`` as one op (float32)."""
    return relax.Call(tvm.ir.Op.get("autoq.hardsigmoid"), [x])


# ---------------------------------------------------------------------------- patterns


def _either(op: str, a: DFPattern, b: DFPattern) -> DFPattern:
    """``op(a, b)`` or ``op(b, a)`` (commutative ops)."""
    return is_op(op)(a, b) | is_op(op)(b, a)


def _scalar(m: dict, p: DFPattern) -> float | None:
    v = const_array(m[p]) if p in m else None
    return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None


def _close(value: float | None, want: float) -> bool:
    return value is not None and math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-12)


def _bound(e) -> float | None:
    try:
        return float(e.value)
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Rule:
    """One decomposition: ``build() -> (pattern, parts)`` and ``rewrite(match, parts) ->
    Expr | None`` (None: the constants are not the operation's; the match is left as it is)."""

    name: str
    build: Callable[[], tuple[DFPattern, dict]]
    rewrite: Callable[[dict, dict], relax.Expr | None]


def _clip_chain():
    x, lo1, hi1, lo2, hi2 = wildcard(), wildcard(), wildcard(), wildcard(), wildcard()
    inner = is_op("relax.clip")(x, lo1, hi1)
    root = is_op("relax.clip")(inner, lo2, hi2)
    return root, {"x": x, "lo1": lo1, "hi1": hi1, "lo2": lo2, "hi2": hi2}


def _merge_clips(m, p):
    lo = max(_bound(m[p["lo1"]]), _bound(m[p["lo2"]]))
    hi = min(_bound(m[p["hi1"]]), _bound(m[p["hi2"]]))
    return relax.op.clip(m[p["x"]], float(lo), float(hi))


def _hard_core(p: dict):
    """``clip(x + 3, 0, 6)`` (torch) or ``clip(x * (1/6) + 0.5, 0, 1)`` (ONNX)."""
    x, three, sixth, half = wildcard(), is_const(), is_const(), is_const()
    lo, hi = wildcard(), wildcard()
    torch_form = is_op("relax.clip")(_either("relax.add", x, three), lo, hi)
    onnx_form = is_op("relax.clip")(
        _either("relax.add", _either("relax.multiply", x, sixth), half), lo, hi
    )
    p.update(x=x, three=three, sixth=sixth, half=half, lo=lo, hi=hi)
    return torch_form, onnx_form


def _hard_scale(m, p) -> float | None:
    """6 when the core is the torch form (still to divide by 6), 1 for the ONNX form, None
    when the constants are not hardsigmoid's."""
    lo, hi = _bound(m[p["lo"]]), _bound(m[p["hi"]])
    if p["three"] in m and _close(_scalar(m, p["three"]), 3.0) and (lo, hi) == (0.0, 6.0):
        return 6.0
    onnx = _close(_scalar(m, p["sixth"]), 1 / 6) and _close(_scalar(m, p["half"]), 0.5)
    return 1.0 if onnx and (lo, hi) == (0.0, 1.0) else None


def _hardswish():
    p: dict = {}
    torch_core, onnx_core = _hard_core(p)
    six = is_const()
    x = p["x"]
    torch_form = is_op("relax.divide")(_either("relax.multiply", x, torch_core), six)
    onnx_form = _either("relax.multiply", x, onnx_core)
    p["six"] = six
    return torch_form | onnx_form, p


def _rewrite_hard(op: Callable[[relax.Expr], relax.Call]):
    """The rewrite into ``op`` when the constants are hardsigmoid's: torch's core still to be
    divided by 6, or ONNX's core (already scaled, no division)."""

    def rewrite(m, p):
        scale = _hard_scale(m, p)
        six = _close(_scalar(m, p["six"]), 6.0)
        return (
            op(m[p["x"]])
            if (scale == 6.0 and six) or (scale == 1.0 and p["six"] not in m)
            else None
        )

    return rewrite


def _hardsigmoid():
    p: dict = {}
    torch_core, onnx_core = _hard_core(p)
    six = is_const()
    p["six"] = six
    return is_op("relax.divide")(torch_core, six) | onnx_core, p


def _silu():
    x = wildcard()
    return _either("relax.multiply", x, is_op("relax.sigmoid")(x)), {"x": x}


def _gelu_erf():
    x, sqrt2, one, half = wildcard(), is_const(), is_const(), is_const()
    erf = is_op("relax.erf")(is_op("relax.divide")(x, sqrt2))
    inner = _either("relax.multiply", x, _either("relax.add", erf, one))
    root = _either("relax.multiply", inner, half)
    return root, {"x": x, "sqrt2": sqrt2, "one": one, "half": half}


def _rewrite_gelu_erf(m, p):
    ok = _close(_scalar(m, p["sqrt2"]), math.sqrt(2.0)) and _close(_scalar(m, p["one"]), 1.0)
    return relax.op.nn.gelu(m[p["x"]]) if ok and _close(_scalar(m, p["half"]), 0.5) else None


def _gelu_tanh():
    x, a, c, one, half = wildcard(), is_const(), is_const(), is_const(), is_const()
    cube = _either("relax.multiply", x, _either("relax.multiply", x, x))
    inner = _either("relax.add", x, _either("relax.multiply", a, cube))
    t = is_op("relax.tanh")(_either("relax.multiply", c, inner))
    root = _either(
        "relax.multiply", half, _either("relax.multiply", x, _either("relax.add", one, t))
    )
    return root, {"x": x, "a": a, "c": c, "one": one, "half": half}


def _rewrite_gelu_tanh(m, p):
    ok = _close(_scalar(m, p["a"]), 0.044715) and _close(_scalar(m, p["c"]), math.sqrt(2 / math.pi))
    ok = ok and _close(_scalar(m, p["one"]), 1.0) and _close(_scalar(m, p["half"]), 0.5)
    return relax.op.nn.gelu_tanh(m[p["x"]]) if ok else None


def _layer_norm():
    x, two, eps, gamma, beta = wildcard(), is_const(), is_const(), wildcard(), wildcard()
    mean = is_op("relax.mean")(x)
    centered = is_op("relax.subtract")(x, mean)
    var = is_op("relax.mean")(is_op("relax.power")(centered, two))
    normed = is_op("relax.divide")(centered, is_op("relax.sqrt")(_either("relax.add", var, eps)))
    root = _either("relax.add", _either("relax.multiply", normed, gamma), beta)
    parts = {"x": x, "two": two, "eps": eps, "gamma": gamma, "beta": beta}
    parts.update(mean=mean, var=var)
    return root, parts


def _rewrite_layer_norm(m, p):
    mean, var = m[p["mean"]], m[p["var"]]
    axes = [int(a) for a in mean.attrs.axis] if mean.attrs.axis is not None else None
    same = axes is not None and var.attrs.axis is not None
    if not (
        same and axes == [int(a) for a in var.attrs.axis] and _close(_scalar(m, p["two"]), 2.0)
    ):
        return None
    eps = _scalar(m, p["eps"])
    gamma, beta = m[p["gamma"]], m[p["beta"]]
    ndim = len(m[p["x"]].ty.shape.values)
    axes = [a % ndim for a in axes]
    if eps is None or axes != list(range(ndim - len(axes), ndim)):
        return None
    if len(gamma.ty.shape.values) != len(axes) or len(beta.ty.shape.values) != len(axes):
        return None
    return relax.op.nn.layer_norm(m[p["x"]], gamma, beta, axes, _f32(eps))


def _float_conv():
    x, w = wildcard(), wildcard()
    return is_op("relax.nn.conv2d")(x, w), {"x": x, "w": w}


def _rewrite_float_conv(m, p):
    call = m["root"]
    a = call.attrs
    if str(a.out_dtype) != "float32" or call.args[0].ty.dtype != "float32":
        return None
    return relax.op.nn.conv2d(
        call.args[0], call.args[1], a.strides, a.padding, a.dilation, a.groups,
        a.data_layout, a.kernel_layout, a.out_layout, None,
    )  # fmt: skip


def _float_matmul():
    a, b = wildcard(), wildcard()
    return is_op("relax.matmul")(a, b), {"a": a, "b": b}


def _rewrite_float_matmul(m, p):
    call = m["root"]
    if str(call.attrs.out_dtype) != "float32" or call.args[0].ty.dtype != "float32":
        return None
    return relax.op.matmul(call.args[0], call.args[1], None)


def _clip_op():
    x, lo, hi = wildcard(), wildcard(), wildcard()
    return is_op("relax.clip")(x, lo, hi), {"x": x, "lo": lo, "hi": hi}


def _float_bounds(m, p):
    """clip bounds as float64 values (importers write ``0``, ``6`` as integers or floats)."""
    lo, hi = m[p["lo"]], m[p["hi"]]
    if str(lo.ty) == "float64" and str(hi.ty) == "float64":
        return None
    return relax.op.clip(m[p["x"]], float(lo.value), float(hi.value))


def _layer_norm_op():
    x, g, b = wildcard(), wildcard(), wildcard()
    return is_op("relax.nn.layer_norm")(x, g, b), {"x": x, "g": g, "b": b}


def _f32(v: float) -> float:
    return float(np.float32(v))


def _canonical_layer_norm(m, p):
    """Positive axes, a float32 epsilon (frontends write -1 and 1e-5 as a double)."""
    call = m["root"]
    a = call.attrs
    ndim = len(call.args[0].ty.shape.values)
    axes = [int(x) % ndim for x in a.axes]
    if axes == [int(x) for x in a.axes] and float(a.epsilon) == _f32(a.epsilon):
        return None
    x, g, b = call.args
    return relax.op.nn.layer_norm(x, g, b, axes, _f32(a.epsilon), bool(a.center), bool(a.scale))


def _leaky():
    x = wildcard()
    return is_op("relax.nn.leakyrelu")(x), {"x": x}


def _canonical_leaky(m, p):
    alpha = float(m["root"].attrs.alpha)
    return None if alpha == _f32(alpha) else relax.op.nn.leakyrelu(m[p["x"]], _f32(alpha))


def _divide_by_constant():
    x, c = wildcard(), is_const()
    return is_op("relax.divide")(x, c), {"x": x, "c": c}


def _reciprocal(m, p):
    """``x / c`` -> ``x * float32(1 / c)`` for a float32 constant ``c`` with no zero or
    non-finite entry. Not bit-identical in float32 (``x * (1/c)`` is within 1.5 ulp of
    ``x / c``; exact when ``c`` is a power of two), far below an 8-bit step (2**-24 vs
    2**-8 relative); one form lets ``x * c`` patterns quantize it."""
    c = const_array(m[p["c"]])
    if c is None or c.dtype != np.float32 or not np.all(np.isfinite(c) & (c != 0)):
        return None
    inv = (np.float64(1.0) / c.astype(np.float64)).astype(np.float32)
    if not np.all(np.isfinite(inv)):
        return None
    return relax.op.multiply(m[p["x"]], relax.const(inv, "float32"))


def _residual_after_reshape():
    x, w, b, r, shape = wildcard(), wildcard(), wildcard(), wildcard(), wildcard()
    dense = is_op("relax.add")(is_op("relax.matmul")(x, w), b)
    reshaped = is_op("relax.reshape")(dense, shape)
    root = _either("relax.add", reshaped, r)
    return root, {"dense": dense, "reshaped": reshaped, "r": r}


def _residual_before_reshape(m, p):
    """``reshape(x @ W + b) + r`` -> ``reshape(x @ W + b + reshape(r))`` when the reshape
    keeps the last axis and ``r`` has its output's shape: the same additions of the same
    float32 numbers (bit-identical), written so that the residual add belongs to the dense
    layer (a transformer's FFN output ``(tokens, hidden)`` reshaped to ``(1, tokens,
    hidden)`` before its residual): the ``dense_bias_add`` pattern then reads the residual
    in float instead of an 8-bit ``add`` layer rounding the residual stream."""
    dense, reshaped, r = m[p["dense"]], m[p["reshaped"]], m[p["r"]]
    d_shape, out_shape, r_shape = (shape_of(e) for e in (dense, reshaped, r))
    if None in (d_shape, out_shape, r_shape) or r_shape != out_shape:
        return None
    if not d_shape or d_shape[-1] != out_shape[-1] or r.ty.dtype != "float32":
        return None
    inner = relax.op.add(dense, relax.op.reshape(r, d_shape))
    return relax.op.reshape(inner, out_shape)


#: the rewrite table, applied in order, each to a fixed point
RULES: list[Rule] = [
    Rule("clip_chain", _clip_chain, _merge_clips),
    Rule("hardswish", _hardswish, _rewrite_hard(hardswish)),
    Rule("hardsigmoid", _hardsigmoid, _rewrite_hard(hardsigmoid)),
    Rule("silu", _silu, lambda m, p: relax.op.nn.silu(m[p["x"]])),
    Rule("gelu_erf", _gelu_erf, _rewrite_gelu_erf),
    Rule("gelu_tanh", _gelu_tanh, _rewrite_gelu_tanh),
    Rule("layer_norm", _layer_norm, _rewrite_layer_norm),
    Rule("float_conv2d", _float_conv, _rewrite_float_conv),
    Rule("float_matmul", _float_matmul, _rewrite_float_matmul),
    Rule("clip_bounds", _clip_op, _float_bounds),
    Rule("layer_norm_attrs", _layer_norm_op, _canonical_layer_norm),
    Rule("leakyrelu_alpha", _leaky, _canonical_leaky),
    # finfo.min attention masks -> a quantizable constant (autoq.ir.attention_mask)
    Rule("attention_mask_multiply", mask_multiply, rewrite_mask_constant),
    Rule("attention_mask_where", mask_where, rewrite_mask_constant),
    # a transformer's FFN residual added before the reshape back to (1, tokens, hidden)
    Rule("residual_before_reshape", _residual_after_reshape, _residual_before_reshape),
    # after every rule that reads a division by a constant (hardswish's / 6, gelu's / sqrt 2)
    Rule("divide_by_constant", _divide_by_constant, _reciprocal),
]


def _leaks(func: relax.Function, matched: dict, root) -> bool:
    """Whether a value inside the match (other than its root) is read outside it or is a
    function output: then rewriting would change what that reader sees (e.g. a sigmoid a
    pre-quantized file rounds before the multiply of a silu), so the rule does not fire.
    A value that is not a binding of ``func`` (made by a rewrite of this pass) counts as a
    leak: the next pass, on the rewritten function, decides."""
    pairs = bindings(func)
    var_of = {value: var for var, value in pairs}
    interior = [
        e
        for p, e in matched.items()
        if not isinstance(p, WildcardPattern | ConstantPattern)
        and isinstance(e, relax.Call)
        and not e.same_as(root)
    ]
    if root not in var_of or any(e not in var_of for e in interior):
        return True
    root_var = var_of[root]
    inside = {var_of[e] for e in interior} | {root_var}
    outputs = set(free_vars(func.body.body))
    for var, value in pairs:
        if var not in inside and any(
            u in inside and not u.same_as(root_var) for u in free_vars(value)
        ):
            return True
    return any(v in outputs for v in inside if not v.same_as(root_var))


def _apply(rule: Rule, func: relax.Function, max_passes: int = 8) -> relax.Function:
    """``rule`` applied until nothing changes (each pass checks leaks on its own input)."""
    root, parts = rule.build()
    for _ in range(max_passes):
        current = func

        def rewriter(expr, matched, current=current):
            m = dict(matched)
            m["root"] = expr
            out = rule.rewrite(m, parts)
            return expr if out is None or _leaks(current, matched, expr) else out

        func = relax.analysis.remove_all_unused(rewrite_call(root, rewriter, current))
        if func.same_as(current) or structural_equal(func, current):
            break
    return func


_COMMUTATIVE = ("relax.add", "relax.multiply")


def _weights_second(func: relax.Function, weights: set[str]) -> relax.Function:
    """``add``/``multiply`` with a weight-only operand (a constant, a parameter named in
    ``weights``, or a value computed from those) write it second: ``add(x, bias)``."""
    fixed = {p for p in func.params if p.name in weights}
    values = {}
    for var, value in bindings(func):
        operands = free_vars(value)
        if (operands and all(u in fixed for u in operands)) or not operands:
            fixed.add(var)
        a = value.args if isinstance(value, relax.Call) else ()
        is_weight = [const_array(e) is not None or e in fixed for e in a]
        if op_name(value) in _COMMUTATIVE and len(a) == 2 and is_weight == [True, False]:
            values[var] = relax.Call(value.op, [a[1], a[0]], value.attrs)
    return rebind(func, values) if values else func


def canonicalize(
    mod: tvm.IRModule, func_name: str = "main", weights: set[str] | None = None
) -> tvm.IRModule:
    """``mod`` with every decomposition of :data:`RULES` in ``func_name`` rewritten into its
    canonical form (see the module docstring), weight operands of add/multiply second
    (``weights``: the names of the function's weight parameters), dead bindings removed."""
    func = _weights_second(mod[func_name], set(weights or ()))
    for rule in RULES:
        func = _apply(rule, func)
    func = relax.analysis.remove_all_unused(func)
    out = with_main(mod, func, func_name)
    return relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(out))
