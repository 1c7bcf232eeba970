"""Find ``kernel -> add(bias) -> qnn.requantize`` chains and hand them to one kernel call.

``realize`` writes a quantized conv / dense as ``qnn.conv2d`` (int32 accumulator), an
``add`` of the int32 bias constant, and a ``qnn.requantize`` to int8/uint8 (a folded ReLU or
ReLU6 is the requantize's output range). :func:`fuse_epilogues` rewrites each such chain
whose intermediate int32 results have no other user (a biased accumulator read only by
requantizes is one chain per requantize, the kernel run for each), and whose requantize has
constant scalar or per-channel (along the kernel's output channel axis) operands, into what
``lower(builder, kernel call, Epilogue)`` returns (a kernel call storing int8 directly); when
``lower`` returns None (the kernels do not cover that call) the chain is left as it is. The
canonical graph is untouched: this runs inside the CPU lowering only. With a ``layout_of``,
the tensors :func:`autoq.cpu.blocked.blocked_edges` picks pass between the kernels in the
blocked layout (producers store it, consumers, also bare int32 convs and lookups, read it).
With a ``residual`` predicate, ``conv + bias + requantize(shortcut) -> int32`` chains ending
in a requantize (:mod:`autoq.cpu.residual`) are chains too: the conv kernel adds the
shortcut term, read blocked or NCHW, and plain int8 elementwise ops between blocked tensors
run blocked (:mod:`autoq.cpu.blocked_elementwise`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import tvm
from tvm import relax

from autoq.cpu.blocked import blocked_edges, blocked_lut, unblocked_lut
from autoq.cpu.blocked_elementwise import blocked_call, blocked_operands
from autoq.cpu.epilogue import Epilogue
from autoq.cpu.residual import Residual, residual_chain
from autoq.ir.toolkit import (
    bindings,
    const_array,
    dtype_of,
    is_call,
    read_counts,
    shape_of,
)
from autoq.qnn.quantize import with_multipliers

__all__ = ["fuse_epilogues"]

KERNEL_OPS = ("qnn.conv2d", "qnn.dense", "qnn.matmul")
OUT_DTYPES = ("int8", "uint8")
# binding values whose variable uses free_vars sees completely
_FLAT = (
    tvm.ir.Call,
    relax.Tuple,
    relax.TupleGetItem,
    relax.Var,
    tvm.ir.GenericConst,
    relax.ShapeExpr,
)


def _channel_vector(v: np.ndarray | None, shape, axis: int):
    """``v`` (a constant broadcast against ``shape``) as a scalar or a per-channel vector
    along ``axis``, or None when it varies along another axis."""
    if v is None or v.ndim > len(shape):
        return None
    full = (1,) * (len(shape) - v.ndim) + v.shape
    axis = axis % len(shape)
    if any(d != 1 for i, d in enumerate(full) if i != axis):
        return None
    flat = v.reshape(-1)
    if flat.size == 1:
        return flat[0]
    return flat if flat.size == shape[axis] else None


def _bias(add: relax.Call, kernel_var, shape, axis: int):
    """The int32 bias of ``add(kernel_var, const)`` (either order) per channel, or None."""
    a, b = add.args
    other = b if a.same_as(kernel_var) else a if b.same_as(kernel_var) else None
    if other is None or dtype_of(other) != "int32":
        return None
    v = _channel_vector(const_array(other), shape, axis)
    if v is None:
        return None
    return np.broadcast_to(np.asarray(v, np.int32), (shape[axis],)).copy()


def _epilogue(req: relax.Call, bias, shape, axis: int, dtypes=OUT_DTYPES) -> Epilogue | None:
    """The :class:`Epilogue` of ``req`` on a kernel output ``shape`` (channels on ``axis``);
    a per-channel operand with one value throughout becomes a scalar."""
    a = req.attrs
    out_dtype, rounding = str(a["out_dtype"]), str(a["rounding"])
    if out_dtype not in dtypes:
        return None
    if rounding != "float" and len(req.args) == 5:
        req = with_multipliers(req)
    per_channel_ok = int(a["axis"]) % len(shape) == axis % len(shape)
    params = []
    for p in req.args[1:]:
        v = const_array(p)
        if v is None:
            return None
        v = v.reshape(-1)
        if v.size == 1 or (v.size == shape[axis] and np.all(v == v[0])):
            params.append(v[0])
        elif v.size == shape[axis] and per_channel_ok:
            params.append(v)
        else:
            return None
    return Epilogue(bias, tuple(params), rounding, out_dtype, shape[axis])


def _residual(req: relax.Call, src, value_of: dict, uses, covered) -> tuple | None:
    """(conv call, Epilogue, ResidualChain, Residual) of the residual chain ``req`` (the
    final requantize) ends, when ``covered(conv)``, else None."""
    chain = residual_chain(src, value_of, uses)
    if chain is None or not covered(value_of[chain.kernel]):
        return None
    shape = shape_of(chain.kernel)
    bias = None
    if chain.bias_add is not None:
        bias = _bias(value_of[chain.bias_add], chain.kernel, shape, 1) if shape else None
        if bias is None:
            return None
    epilogue = _epilogue(req, bias, shape, 1) if shape else None
    short = _epilogue(value_of[chain.shortcut_requantize], None, shape, 1, ("int32",))
    if epilogue is None or short is None:
        return None
    codes = dtype_of(chain.shortcut)
    residual = Residual(replace(short, codes=codes), codes)
    return value_of[chain.kernel], epilogue, chain, residual


def _chains(func: relax.Function, covered=None) -> tuple[dict, dict, dict]:
    """``{requantize var: (kernel call, Epilogue)}`` for every fusable chain of ``func``,
    ``{requantize var: (kernel var, bias add var or None)}``, and (with ``covered(conv)``,
    the convs whose kernel takes a residual) ``{requantize var: (ResidualChain, Residual)}``
    for the residual chains among them."""
    pairs = bindings(func)
    if not all(isinstance(e, _FLAT) for _, e in pairs):
        return {}, {}, {}  # nested scopes (If, inner functions): uses are not all visible
    value_of = dict(pairs)
    uses = read_counts(func)
    # requantizes reading each variable: a biased accumulator read only by requantizes
    # (YOLOv8's head convs: one per concat scale) is one chain per requantize, the kernel
    # run once per chain instead of writing the int32 tensor for all of them
    requantized = Counter(
        e.args[0]
        for _, e in pairs
        if is_call(e, "qnn.requantize") and isinstance(e.args[0], relax.Var)
    )
    found, parts, residuals = {}, {}, {}
    for var, req in pairs:
        if not is_call(req, "qnn.requantize") or not isinstance(req.args[0], relax.Var):
            continue
        src, bias, add_var = req.args[0], None, None
        res = _residual(req, src, value_of, uses, covered) if covered else None
        if res is not None:
            found[var], parts[var], residuals[var] = res[:2], res[2].parts, res[2:]
            continue
        kernel = value_of.get(src)
        if is_call(kernel, "relax.add") and uses[src] == requantized[src]:
            add_var = src
            src = next((a for a in kernel.args if isinstance(a, relax.Var)), None)
            kernel = value_of.get(src)
            if not is_call(kernel, *KERNEL_OPS) or uses[src] != 1:
                continue
            shape = shape_of(src)
            axis = 1 if is_call(kernel, "qnn.conv2d") else -1
            bias = _bias(value_of[add_var], src, shape, axis) if shape else None
            if bias is None:
                continue
        elif not is_call(kernel, *KERNEL_OPS) or uses[src] != 1:
            continue
        shape = shape_of(src)
        if shape is None or dtype_of(src) != "int32":
            continue
        axis = 1 if is_call(kernel, "qnn.conv2d") else -1
        epilogue = _epilogue(req, bias, shape, axis)
        if epilogue is not None:
            found[var] = (kernel, epilogue)
            parts[var] = (src, add_var)
    return found, parts, residuals


def fuse_epilogues(
    mod: tvm.IRModule,
    lower: Callable,
    layout_of: Callable | None = None,
    lut_layout: Callable | None = None,
    residual: Callable | None = None,
    any_layout: Callable | None = None,
):
    """``mod`` with every fusable chain of its Relax functions replaced by ``lower(builder,
    kernel call, epilogue, fed, out_layout, residual)``'s call (chains ``lower`` declines
    stay); the dead kernel / add bindings are removed. ``layout_of(conv call)``: the blocked
    layout the kernels read that conv's data in, or None (see
    :func:`autoq.cpu.blocked.blocked_edges`); with it, chains between convs pass ``fed`` =
    (blocked variable, layout) for the data of the consumer and ``out_layout`` to the
    producer (None elsewhere / without it); ``lut_layout(dtype)``: the blocked layout a
    ``qnn.lut`` can read directly, or None. ``residual(conv call)``: whether the conv's kernel
    takes a residual add in its epilogue (:mod:`autoq.cpu.residual`; None: never); those
    chains pass ``residual`` = (:class:`Residual` with the shortcut's layout, shortcut
    expression), the shortcut read blocked when its producer stores it blocked.
    ``any_layout(dtype)`` (with ``layout_of``): plain int8 elementwise ops between blocked
    tensors run blocked too (:mod:`autoq.cpu.blocked_elementwise`), and a tensor read only
    by them and residual shortcuts is stored in that layout."""
    out = mod
    changed = False
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        chains, parts, residuals = _chains(func, residual)
        if chains:
            edges = {}
            if layout_of is not None:
                luts = lut_layout or (lambda _dtype: None)
                shortcuts = {chain.shortcut_requantize for chain, _ in residuals.values()}
                edges = blocked_edges(
                    func, chains, layout_of, luts, shortcuts, blocked_operands, any_layout
                )
            out = _Rewrite(out, chains, lower, edges, parts, residuals).run(gv, func)
            changed = True
    if not changed:
        return mod
    return relax.transform.DeadCodeElimination()(out)


@relax.expr_functor.mutator
class _Rewrite(relax.PyExprMutator):
    def __init__(self, mod, chains, lower, edges, parts, residuals):
        super().__init__(mod)
        self.mod_, self.chains, self.lower, self.edges = mod, chains, lower, edges
        self.residuals = residuals
        self.fed = {}  # producer requantize var -> (blocked var, layout), once emitted
        # the kernel / bias bindings of chains reading a blocked tensor are never emitted
        # (their data variable is not bound any more), nor those of residual chains (their
        # kernels always take them)
        self.skip = set()
        for var, (kernel, _) in chains.items():
            if var in residuals or any(kernel.args[0].same_as(e) for e in edges):
                self.skip.update(v for v in parts[var] if v is not None)

    def run(self, gv, func):
        new = self.visit_expr(func)
        self.builder_.update_func(gv, new)
        return self.builder_.finalize()

    def _residual(self, var):
        """(Residual in its shortcut's layout, shortcut expression) of a residual chain."""
        if var not in self.residuals:
            return None
        chain, residual = self.residuals[var]
        fed = self.fed.get(chain.shortcut)
        if fed is None:
            return residual, self.visit_expr(chain.shortcut)
        return replace(residual, layout=fed[1]), fed[0]

    def visit_var_binding_(self, binding):
        if binding.var in self.skip:
            return
        if binding.var in self.edges and not self.chains.get(binding.var):
            layout = self.edges[binding.var]
            if is_call(binding.value, "qnn.lut"):
                data, _ = self.fed[binding.value.args[0]]
                value = blocked_lut(self.builder_, binding.value, data, layout)
            else:  # an elementwise op
                value = blocked_call(self.builder_, binding.value, self.fed, layout)
            self.fed[binding.var] = (self.builder_.emit(value), layout)
            return
        if is_call(binding.value, "qnn.lut") and binding.value.args[0] in self.fed:
            data, layout = self.fed[binding.value.args[0]]  # a blocked input, NCHW output
            value = self.builder_.normalize(
                unblocked_lut(self.builder_, binding.value, data, layout)
            )
            self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
            return
        if is_call(binding.value, "qnn.conv2d"):
            fed = self.fed.get(binding.value.args[0])
            if fed is not None:  # a bare conv (int32 output) reading a blocked tensor
                value = self.lower(self.builder_, binding.value, None, fed, None)
                if value is None:
                    raise RuntimeError(f"blocked layout: no kernel for {binding.var.name_hint}")
                value = self.builder_.normalize(value)
                self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
                return
        chain = self.chains.get(binding.var)
        if chain is not None:
            kernel, epilogue = chain
            fed = self.fed.get(kernel.args[0]) if isinstance(kernel.args[0], relax.Var) else None
            layout = self.edges.get(binding.var)
            if fed is None:
                kernel = self.visit_expr(kernel)
            residual = self._residual(binding.var)
            value = self.lower(self.builder_, kernel, epilogue, fed, layout, residual)
            if value is None and (fed is not None or layout is not None or residual):
                raise RuntimeError(f"blocked layout: no kernel for {binding.var.name_hint}")
            if value is not None:
                value = self.builder_.normalize(value)
                if layout is not None:
                    self.fed[binding.var] = (self.builder_.emit(value), layout)
                else:
                    self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
                return
        super().visit_var_binding_(binding)
