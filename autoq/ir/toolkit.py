"""The Relax toolkit: every small helper that reads or builds Relax expressions.

Every stage (simulate, calibrate, realize, analysis, import) uses these instead of its own
copy. It is the only module that touches ``BlockBuilder``'s private block API
(:class:`BindingWriter`), so a TVM upgrade that changes it is fixed here once.

Reading expressions::

    >>> import numpy as np
    >>> from tvm import relax

    >>> x = relax.Var("x", relax.TensorType([1, 4], "float32"))
    >>> call = relax.BlockBuilder().normalize(relax.op.nn.relu(x))  # (its shape inferred)
    >>> op_name(call), short_op_name(call), is_call(call, "relax.nn.relu")
    ('relax.nn.relu', 'relu', True)
    >>> shape_of(call), dtype_of(call)
    ((1, 4), 'float32')
    >>> const_array(const(np.int8(3))).dtype
    dtype('int8')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import tvm
from tvm import relax

from autoq.ir.compile_cache import cached_module

__all__ = [
    "BindingWriter",
    "as_list",
    "bindings",
    "compile_executable",
    "compile_vm",
    "compile_vms",
    "const",
    "const_array",
    "dtype_of",
    "free_vars",
    "is_call",
    "make_function",
    "op_name",
    "output_fields",
    "read_counts",
    "remap_expr",
    "shape_of",
    "short_op_name",
    "slice_bindings",
    "with_main",
]


# ----------------------------------------------------------------------------- reading


def op_name(expr) -> str:
    """Full op name of a call (``relax.nn.conv2d``), or a kind for other expressions
    (``call``, ``tuple``, ``get_item``, ``alias``, ``const``)."""
    if isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    if isinstance(expr, tvm.ir.Call):
        return "call"
    if isinstance(expr, relax.Tuple):
        return "tuple"
    if isinstance(expr, relax.TupleGetItem):
        return "get_item"
    if isinstance(expr, relax.Var):
        return "alias"
    if isinstance(expr, tvm.ir.GenericConst):
        return "const"
    return type(expr).__name__.lower()


def short_op_name(expr_or_name) -> str:
    """``relax.nn.conv2d`` -> ``conv2d``; ``relax.add`` -> ``add``; ``qnn.add`` -> ``qnn.add``."""
    name = expr_or_name if isinstance(expr_or_name, str) else op_name(expr_or_name)
    if name.startswith("relax."):
        name = name.split(".")[-1]
    return name


def is_call(expr, *names: str) -> bool:
    """Whether ``expr`` is a call of one of the ops ``names`` (any op when none is given)."""
    if not (isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op)):
        return False
    return not names or expr.op.name in names


def const_array(expr) -> np.ndarray | None:
    """The numpy value of a tensor constant, else None."""
    if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.value, tvm.runtime.Tensor):
        return expr.value.numpy()
    return None


def shape_of(expr) -> tuple[int, ...] | None:
    """Static shape of a tensor-typed expression, else None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(d) for d in ty.shape.values)
    except (TypeError, ValueError, AttributeError):
        return None


def dtype_of(expr) -> str | None:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def free_vars(expr) -> list[relax.Var]:
    """Relax variables an expression reads (bindings or parameters), in first-use order."""
    out: list[relax.Var] = []

    def visit(e):
        if isinstance(e, relax.Var):
            if not any(e.same_as(v) for v in out):
                out.append(e)
        elif isinstance(e, tvm.ir.Call):
            for a in e.args:
                visit(a)
        elif isinstance(e, relax.Tuple):
            for f in e.fields:
                visit(f)
        elif isinstance(e, relax.TupleGetItem):
            visit(e.tuple_value)

    visit(expr)
    return out


def bindings(func: relax.Function) -> list[tuple[relax.Var, relax.Expr]]:
    """``(var, value)`` of every binding of ``func``, blocks flattened, in order."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return []
    return [(b.var, b.value) for block in body.blocks for b in block.bindings]


def read_counts(func: relax.Function) -> Counter:
    """How many bindings of ``func`` and its output read each variable (a variable read
    twice by one expression counts once).

    >>> from tvm.script import relax as R
    >>> @R.function
    ... def f(x: R.Tensor((2,), "float32")):
    ...     y = R.add(x, x)
    ...     z = R.multiply(y, x)
    ...     return (z, y)
    >>> sorted((v.name, n) for v, n in read_counts(f).items())
    [('x', 2), ('y', 2), ('z', 1)]
    """
    uses = Counter(v for _, e in bindings(func) for v in free_vars(e))
    if isinstance(func.body, relax.SeqExpr):
        uses.update(free_vars(func.body.body))
    return uses


def output_fields(expr) -> list:
    """The fields of a tuple output, or ``[expr]``."""
    return list(expr.fields) if isinstance(expr, relax.Tuple) else [expr]


def slice_bindings(pairs: Sequence, outputs: Iterable, stop: Iterable = ()) -> list:
    """The bindings of ``pairs`` needed to compute ``outputs`` when the vars in ``stop`` are
    given (inputs), in their original order."""
    value_of = dict(pairs)
    stop = set(stop)
    needed: set = set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if v in needed or v in stop or v not in value_of:
            continue
        needed.add(v)
        stack.extend(free_vars(value_of[v]))
    return [(v, e) for v, e in pairs if v in needed]


# ---------------------------------------------------------------------------- building


def const(value, dtype: str | None = None) -> relax.Expr:
    """A tensor constant with an explicit dtype (``relax.const`` alone would turn int64 and
    float64 into int32 and float32)."""
    a = np.asarray(value)
    if dtype is not None:
        a = a.astype(dtype)
    return relax.const(a, str(a.dtype))


def remap_expr(expr, vmap: dict):
    """Rebuild ``expr`` with its free variables replaced through ``vmap`` (others kept)."""
    if isinstance(expr, relax.Var):
        return vmap.get(expr, expr)
    if isinstance(expr, tvm.ir.Call):
        args = [remap_expr(a, vmap) for a in expr.args]
        return tvm.ir.Call(expr.op, args, expr.attrs, list(expr.ty_args))
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([remap_expr(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(remap_expr(expr.tuple_value, vmap), expr.index)
    return expr


def with_main(mod: tvm.IRModule, func: relax.Function, name: str = "main") -> tvm.IRModule:
    """A copy of ``mod`` whose ``name`` function is ``func``, keeping its other functions
    (PrimFuncs called by ``call_tir``, e.g. an imported ONNX ``Pad``) and attributes."""
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    out[name] = func
    return out


def rewrite_main(mod: tvm.IRModule, rewrite: Callable) -> tvm.IRModule:
    """``mod`` with each binding ``var = value`` of ``main`` bound to ``rewrite(value, once,
    lookup)`` instead where that is not None, then the unused bindings removed (``mod``
    itself when nothing changed or there is no ``main``). ``lookup(var)``: the value bound to
    ``var`` in the original ``main`` (None for a parameter); ``once(var)``: the same for a
    variable read exactly once, else None. The new value's free variables are the original
    ones (they are remapped to the rewritten bindings)."""
    if not any(gv.name_hint == "main" for gv in mod.get_global_vars()):
        return mod
    func = mod["main"]
    value = dict(bindings(func))
    uses = read_counts(func)

    def once(var):
        return value.get(var) if uses[var] == 1 else None

    w = BindingWriter()
    vmap: dict = {}
    changed = False
    for var, e in bindings(func):
        new = rewrite(e, once, value.get)
        changed = changed or new is not None
        vmap[var] = w.emit(remap_expr(e if new is None else new, vmap), var.name)
    if not changed:
        w.abandon()
        return mod
    out = w.finish(func.params, remap_expr(func.body.body, vmap), func.attrs)
    return with_main(mod, relax.analysis.remove_all_unused(out))


class BindingWriter:
    """Emit bindings one by one into a dataflow block, then wrap them in a function whose
    parameters may be decided *after* the walk (simulate adds one qparam input per slot it
    creates). The one place that uses ``BlockBuilder``'s private block API."""

    def __init__(self):
        self.bb = relax.BlockBuilder()
        self.bb._begin_dataflow_block()
        self._done = False

    def emit(self, expr, name: str = "") -> relax.Var:
        return self.bb.emit(expr, name_hint=name)

    def lookup(self, var: relax.Var):
        """The value bound to ``var`` (after normalization)."""
        return self.bb.lookup_binding(var)

    def abandon(self) -> None:
        """Close the open block without building a function (on an error)."""
        if not self._done:
            self._done = True
            self.bb._end_block()

    def finish(self, params: Sequence[relax.Var], output, attrs=None) -> relax.Function:
        """The function ``params -> output`` over the emitted bindings."""
        if self._done:
            raise RuntimeError("BindingWriter.finish called twice")
        self._done = True
        out = self.bb.emit_output(output)
        block = self.bb._end_block()
        body = self.bb.normalize(relax.SeqExpr([block], out))
        return relax.Function(list(params), body, out.ty, attrs=attrs)


def make_function(
    name: str, inputs: Sequence[relax.Var], pairs: Sequence, outputs: Sequence
) -> relax.Function:
    """A function ``name(inputs) -> tuple(outputs)`` from bindings ``pairs`` of another
    function (its parameters are fresh copies of ``inputs``)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(v.name, v.ty) for v in inputs]
    vmap = dict(zip(inputs, params, strict=True))
    with bb.function(name, params):
        with bb.dataflow():
            for var, value in pairs:
                vmap[var] = bb.emit(remap_expr(value, vmap), name_hint=var.name)
            ret = bb.emit_output(relax.Tuple([vmap.get(v, v) for v in outputs]))
        bb.emit_func_output(ret)
    return bb.get()[name]


# ---------------------------------------------------------------------------- running


def compile_executable(
    functions: dict[str, relax.Function],
    target,
    base: tvm.IRModule | None = None,
    pipeline=None,
):
    """One module with ``functions`` (plus ``base``'s functions other than ``main``, e.g. the
    PrimFuncs of an imported model's ``call_tir`` bindings), compiled (a Relax executable:
    run it in a ``VirtualMachine`` or ``export_library`` it for another process) with the
    Relax ``pipeline`` pass (default ``tvm.compile``'s)."""
    return _compile(_module(functions, base), target, pipeline)


def _module(functions: dict[str, relax.Function], base: tvm.IRModule | None) -> tvm.IRModule:
    mod = tvm.IRModule(functions)
    if base is not None:
        for gv, f in base.functions_items():
            if gv.name_hint != "main" and gv.name_hint not in functions:
                mod[gv] = f
    return mod


def _compile(mod: tvm.IRModule, target, pipeline):
    if pipeline is None:
        return tvm.compile(mod, target)
    return tvm.compile(mod, target, relax_pipeline=pipeline)


def compile_vm(
    functions: dict[str, relax.Function],
    target,
    base: tvm.IRModule | None = None,
    pipeline=None,
) -> relax.VirtualMachine:
    """:func:`compile_executable` in a VM on this CPU."""
    return compile_vms(functions, target, base, pipeline)[0]


def compile_vms(
    functions: dict[str, relax.Function],
    target,
    base: tvm.IRModule | None = None,
    pipeline=None,
    count: int = 1,
) -> list[relax.VirtualMachine]:
    """``count`` VMs on this CPU over one :func:`compile_executable`: the same code (loaded
    once), each with its own state, so two threads can call them at once. The library comes
    from the compile cache (:mod:`autoq.ir.compile_cache`) when ``pipeline`` is None or one
    of autoq's named pipelines (``autoq.*``)."""
    mod = _module(functions, base)
    kind = "tvm.default" if pipeline is None else pipeline.info.name
    if kind.startswith("autoq.") or pipeline is None:
        space = 2 * sum(weight_bytes(mod).values())
        lib = cached_module(mod, target, kind, lambda: _compile(mod, target, pipeline), space)
    else:  # an anonymous pipeline: nothing to key the cache on
        lib = _compile(mod, target, pipeline).jit()
    return [relax.VirtualMachine(lib, tvm.cpu()) for _ in range(count)]


def weight_bytes(mod, params=None) -> dict[str, int]:
    """Bytes of the constant tensors of ``mod``'s Relax functions plus ``params``, by dtype
    (each distinct constant counted once): the weights a compiled module carries."""
    seen: dict[int, object] = {}

    def visit(e):
        if isinstance(e, tvm.ir.GenericConst) and isinstance(e.value, tvm.runtime.Tensor):
            seen[hash(e.value)] = e.value

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    out: dict[str, int] = {}
    for t in seen.values():
        n = int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize
        out[str(t.dtype)] = out.get(str(t.dtype), 0) + n
    for a in (params or {}).values():
        a = np.asarray(a)
        out[str(a.dtype)] = out.get(str(a.dtype), 0) + a.nbytes
    return out


def as_list(result) -> list:
    """A VM result as a list of tensors (a single tensor becomes a one-element list)."""
    if isinstance(result, tvm.runtime.Tensor):
        return [result]
    return list(result)
