"""SmoothQuant on the float graph: activation outliers of LayerNorm outputs migrated into the
weights of the dense layers that read them, before calibration (``Config.smooth_quant``;
Xiao et al. 2023, arXiv:2211.10438; the factors: :func:`autoq.accuracy.smoothing.smoothing_scales`).

For every ``R.nn.layer_norm`` over the last axis (with ``gamma`` and ``beta``) whose output
``y`` feeds, directly or through reshapes that keep the last axis, a ``R.matmul(., W)`` with
a constant ``(K, N)`` weight:

1. ``max |y_j|`` per channel over the calibration samples (one float run of the graph);
2. ``s = smoothing_scales(max|y_j|, max_n |W[j, n]| over every such W, alpha)``;
3. ``gamma /= s``, ``beta /= s`` (the LayerNorm now writes ``y / s``) and every such
   ``W[j, :] *= s_j``; exact to float rounding;
4. when ``y`` has *other* readers (the residual add of a post-LN block such as BERT's), they
   keep the original LayerNorm and a second one with ``gamma / s``, ``beta / s`` (constants)
   feeds the dense layers: both read the same (quantized) input, and each output gets its
   own int8 grid. (A compensating ``multiply(y / s, s)`` for the residual would be an int8
   layer with a per-tensor quantized constant ``s``: its error lands on the residual
   stream.) In a pre-LN block (GPT/OPT/LLaMA style) the LayerNorm feeds only the dense
   layers and is rewritten in place.

A weight is rewritten in place when it is a parameter (or a constant) that only this
matmul reads (or a ``permute_dims`` of one, as exported linear layers are); a matmul whose
weight is shared keeps its weight and reads the compensated tensor like any other reader.
The result is a new ``(module, params)`` for :func:`autoq.ir.matching.match`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq.accuracy.smoothing import channel_absmax, smoothing_scales, weight_absmax
from autoq.config.progress import bar
from autoq.ir.graph import Graph
from autoq.ir.run import calibration_pipeline, fp32_runner
from autoq.ir.toolkit import (
    compile_vm,
    const,
    const_array,
    make_function,
    op_name,
    remap_expr,
    shape_of,
    with_main,
)

__all__ = [
    "SmoothPlan",
    "activation_maxima",
    "apply_smoothing",
    "find_smoothable",
    "smooth_graph",
]


@dataclass
class SmoothPlan:
    """One LayerNorm to smooth: its output var, channel count, the matmuls whose weights
    absorb ``s`` (var -> how to rewrite the weight), the readers of ``y`` on the way to them
    (the matmuls or reshapes before them) and the other readers (which keep ``y``)."""

    ln: relax.Var
    channels: int
    matmuls: dict = field(default_factory=dict)  # matmul var -> _WeightSite
    readers: list = field(default_factory=list)  # reader vars of ln that go smoothed
    others: list = field(default_factory=list)  # reader vars of ln that keep it
    scale: np.ndarray | None = None
    alpha: float | None = None  # the migration strength ``scale`` was computed with


@dataclass(frozen=True)
class _WeightSite:
    """Where a matmul's ``(K, N)`` weight lives: a parameter ``name`` (stored transposed when
    ``transposed``: the matmul reads ``permute_dims(param)``) or a constant operand."""

    array: np.ndarray  # as the matmul reads it, (K, N)
    name: str | None
    transposed: bool = False


def _single_user(g: Graph, var, user) -> bool:
    return g.users.get(var, []) == [user]


def _param_name(g: Graph, var) -> str | None:
    names = {p: p.name for p in g.weight_params}
    return names.get(var) if isinstance(var, relax.Var) else None


def _weight_site(g: Graph, mm_var, rhs, k: int) -> _WeightSite | None:
    """The matmul's rewritable weight (module docstring), or None."""
    ref = g.weight_of(rhs)
    if ref is None or ref.array.ndim != 2 or ref.array.shape[0] != k:
        return None
    if const_array(rhs) is not None:
        return _WeightSite(ref.array, None)
    name = _param_name(g, rhs)
    if name is not None and _single_user(g, rhs, mm_var):
        return _WeightSite(ref.array, name)
    inner = g.value.get(rhs)
    if op_name(inner) == "relax.permute_dims" and _single_user(g, rhs, mm_var):
        src = inner.args[0]
        axes = inner.attrs.axes
        two_d = axes is None or [int(a) for a in axes] == [1, 0]
        name = _param_name(g, src)
        if two_d and name is not None and _single_user(g, src, rhs):
            return _WeightSite(ref.array, name, transposed=True)
    return None


def _is_matmul(g: Graph, var, x) -> bool:
    val = g.value.get(var)
    return op_name(val) == "relax.matmul" and val.args[0].same_as(x)


def _keeps_last_axis(g: Graph, var, c: int) -> bool:
    shape = shape_of(var)
    return op_name(g.value.get(var)) == "relax.reshape" and bool(shape) and shape[-1] == c


def _plan_for(g: Graph, ln, value) -> SmoothPlan | None:
    shape = shape_of(ln)
    attrs = value.attrs
    if not shape or not (bool(attrs.center) and bool(attrs.scale)):
        return None
    axes = [int(a) % len(shape) for a in attrs.axes]
    if axes != [len(shape) - 1] or str(ln.ty.dtype) != "float32":
        return None
    c = shape[-1]
    for arg in value.args[1:3]:
        if not _affine_site(g, arg, ln, c):
            return None
    plan = SmoothPlan(ln, c)
    for u in g.users.get(ln, []):
        if _is_matmul(g, u, ln) and (site := _weight_site(g, u, g.value[u].args[1], c)):
            plan.matmuls[u] = site
            plan.readers.append(u)
            continue
        if _keeps_last_axis(g, u, c):
            uu = g.users.get(u, [])
            sites = [_is_matmul(g, m, u) and _weight_site(g, m, g.value[m].args[1], c) for m in uu]
            if uu and all(sites):
                plan.matmuls.update(zip(uu, sites, strict=True))
                plan.readers.append(u)
                continue
        plan.others.append(u)
    return plan if plan.matmuls else None


def _affine_site(g: Graph, arg, ln, c: int) -> bool:
    """gamma/beta: a constant, or a parameter only this LayerNorm reads, of ``c`` values."""
    ref = g.weight_of(arg)
    if ref is None or ref.array.shape != (c,):
        return False
    if const_array(arg) is not None:
        return True
    return _param_name(g, arg) is not None and _single_user(g, arg, ln)


def find_smoothable(g: Graph) -> list[SmoothPlan]:
    """The LayerNorms SmoothQuant applies to (module docstring), in graph order."""
    plans = []
    for var, value in g.bindings:
        if op_name(value) == "relax.nn.layer_norm":
            plan = _plan_for(g, var, value)
            if plan is not None:
                plans.append(plan)
    return plans


def activation_maxima(g: Graph, plans: list[SmoothPlan], samples, target) -> list[np.ndarray]:
    """``max |y_j|`` per channel of each plan's LayerNorm output over ``samples``."""
    outs = [p.ln for p in plans]
    fn = make_function("main", list(g.inputs) + list(g.weight_params), g.bindings, outs)
    vm = compile_vm({"main": fn}, target, g.module, pipeline=calibration_pipeline(target))
    run = fp32_runner(vm, [v.name for v in g.inputs], [g.params[p.name] for p in g.weight_params])
    maxima = [np.zeros(p.channels) for p in plans]
    total = len(samples) if hasattr(samples, "__len__") else None
    for values in bar(run(samples), total=total, desc="smooth_quant", unit="sample"):
        for i, y in enumerate(values):
            if np.size(y):
                maxima[i] = np.maximum(maxima[i], channel_absmax(y))
    return maxima


def apply_smoothing(g: Graph, plans: list[SmoothPlan]):
    """The rewritten ``(module, params)`` for plans with their ``scale`` set."""
    params = dict(g.params)
    new_values: dict = {}  # binding var -> value with constant operands replaced
    twins: dict = {}  # LayerNorm var -> (gamma / s, beta / s) of its smoothed twin

    def put(site_var, operand_index, arr, site_param):
        if site_param is not None:
            params[site_param] = arr
        else:
            val = new_values.get(site_var, g.value[site_var])
            args = list(val.args)
            args[operand_index] = const(arr)
            new_values[site_var] = tvm.ir.Call(val.op, args, val.attrs, list(val.ty_args))

    for p in plans:
        s = p.scale
        lnv = g.value[p.ln]
        affine = [g.weight_of(lnv.args[i]).array for i in (1, 2)]
        affine = [(a.astype(np.float64) / s).astype(a.dtype) for a in affine]
        if p.others:
            twins[p.ln] = affine
        else:
            for i, arr in zip((1, 2), affine, strict=True):
                put(p.ln, i, arr, _param_name(g, lnv.args[i]))
        for mm, site in p.matmuls.items():
            arr = (site.array.astype(np.float64) * s[:, None]).astype(site.array.dtype)
            put(mm, 1, arr.T.copy() if site.transposed else arr, site.name)
    return _rebuild(g, plans, new_values, twins), params


def _rebuild(g: Graph, plans: list[SmoothPlan], new_values: dict, twins: dict):
    bb = relax.BlockBuilder()
    fparams = [relax.Var(p.name, p.ty) for p in g.func.params]
    vmap = dict(zip(g.func.params, fparams, strict=True))
    reads = {u: p.ln for p in plans for u in p.readers}
    smoothed: dict = {}
    attrs = dict(g.func.attrs.items()) if g.func.attrs is not None else None
    with bb.function("main", fparams, attrs=attrs):
        with bb.dataflow():
            for var, value in g.bindings:
                value = new_values.get(var, value)
                local = {**vmap, reads[var]: smoothed[reads[var]]} if var in reads else vmap
                vmap[var] = smoothed[var] = bb.emit(remap_expr(value, local), name_hint=var.name)
                if var in twins:
                    args = [remap_expr(value.args[0], vmap), *(const(a) for a in twins[var])]
                    twin = tvm.ir.Call(value.op, args, value.attrs, list(value.ty_args))
                    smoothed[var] = bb.emit(twin, name_hint=f"{var.name}_smooth")
            out = bb.emit_output(remap_expr(g.output, vmap))
        bb.emit_func_output(out)
    return with_main(g.module, bb.get()["main"])


def smooth_graph(g: Graph, samples, alpha: float, target):
    """SmoothQuant with migration strength ``alpha``: ``(module, params, plans)`` (the module
    unchanged, as ``g.module``/``g.params``, when nothing applies); each plan's ``alpha`` and
    ``scale`` record it."""
    plans = find_smoothable(g)
    if not plans:
        return g.module, dict(g.params), []
    maxima = activation_maxima(g, plans, samples, target)
    for p, amax in zip(plans, maxima, strict=True):
        weights = [site.array for site in p.matmuls.values()]
        p.alpha, p.scale = alpha, smoothing_scales(amax, weight_absmax(weights), alpha)
    mod, params = apply_smoothing(g, plans)
    return mod, params, plans
