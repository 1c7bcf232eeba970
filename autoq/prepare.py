"""Graph preparation passes that run before quantization (on Relax modules with named params).

:func:`fold_batch_norm` folds inference-mode ``relax.nn.batch_norm`` into the convolution
that feeds it, so that per-channel weight scales are chosen on the weights the int8 kernel
will really use. Exporters differ: ONNX exports are usually already folded (and
:func:`autoq.frontends.from_onnx` lets ONNX Runtime fold what is left), while
``torch.export`` keeps every ``batch_norm``.

Decisions:

* Only the value-preserving case is folded: ``batch_norm(conv(x, W) [+ b])`` with
  ``training=False``, where ``conv`` is ``nn.conv1d``/``conv2d``/``conv3d`` (any groups) or
  ``nn.conv1d_transpose``/``conv2d_transpose`` with ``groups == 1``, the batch-norm axis is
  the convolution's output-channel axis, every intermediate value has the batch norm as its
  only user, ``W`` is a named parameter used by that convolution only, and the batch-norm
  statistics and the bias are parameters or constants. Anything else is left untouched
  (it still computes the right thing, it just is not folded); the function never guesses.
* With ``s = gamma / sqrt(var + eps)`` (computed in float64, stored in the weight's dtype):
  ``W' = W * s`` along the kernel's output-channel axis and ``b' = (b - mean) * s + beta``.
* Names: the folded weight keeps its parameter name (``layer1.0.conv1.weight`` now holds the
  folded values) so layer ids and fallback rules keep working. An existing bias parameter
  keeps its name and gets the folded values; when the convolution had no bias a new
  parameter is added, named after the weight (``conv1.weight`` -> ``conv1.bias``,
  otherwise ``<weight>.bias``; a numeric suffix is added on a clash). Batch-norm parameters
  that are no longer used are removed from the function and from ``params``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from .toolkit import with_main

__all__ = ["drop_unused_params", "fold_affine", "fold_batch_norm", "rebind", "rename_params"]

_CONV_OPS = {
    "relax.nn.conv1d": False,
    "relax.nn.conv2d": False,
    "relax.nn.conv3d": False,
    "relax.nn.conv1d_transpose": True,
    "relax.nn.conv2d_transpose": True,
}
_RESHAPE_OPS = ("relax.reshape", "relax.expand_dims")


def _as_numpy(v) -> np.ndarray:
    return v.numpy() if hasattr(v, "numpy") else np.asarray(v)


def _op_name(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return str(expr.op.name)
    return None


def _const_array(expr) -> np.ndarray | None:
    if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.value, tvm.runtime.Tensor):
        return expr.value.numpy()
    return None


def _shape(expr) -> tuple[int, ...] | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    try:
        return tuple(int(d) for d in ty.shape.values)
    except (TypeError, AttributeError):
        return None


def _flatten(func: relax.Function) -> list:
    out = []
    if isinstance(func.body, relax.SeqExpr):
        for block in func.body.blocks:
            out.extend(block.bindings)
    return out


def _uses(func: relax.Function, bindings) -> dict[relax.Var, list]:
    """For every var, the list of its users: binding vars, or None for the function result.

    A var used twice by one expression (``add(x, x)``) appears twice.
    """
    users: dict[relax.Var, list] = {}

    def record(expr, user):
        parts = list(expr.args) if isinstance(expr, relax.Call) else [expr]
        for part in parts:
            for v in relax.analysis.free_vars(part):
                users.setdefault(v, []).append(user)

    for b in bindings:
        record(b.value, b.var)
    body = func.body.body if isinstance(func.body, relax.SeqExpr) else func.body
    record(body, None)
    return users


def rename_params(func: relax.Function, names: dict[relax.Var, str]) -> relax.Function:
    """Return ``func`` with the given parameters renamed (types, body and attributes kept)."""
    if not names:
        return func
    new_params = []
    binding = {}
    for p in func.params:
        if p in names and names[p] != p.name:
            nv = relax.Var(names[p], p.ty)
            binding[p] = nv
            new_params.append(nv)
        else:
            new_params.append(p)
    if not binding:
        return func
    bound = func.bind_params(binding)
    return relax.Function(new_params, bound.body, func.ret_ty, func.is_pure, func.attrs)


def drop_unused_params(
    func: relax.Function, params: dict[str, np.ndarray]
) -> tuple[relax.Function, dict[str, np.ndarray]]:
    """Remove weight parameters (names in ``params``) that the body no longer uses.

    Data inputs (parameters not in ``params``) are always kept.
    """
    used = set(relax.analysis.free_vars(func.body))
    keep = [p for p in func.params if p.name not in params or p in used]
    if len(keep) == len(func.params):
        return func, params
    kept_names = {p.name for p in keep}
    new_params = {k: v for k, v in params.items() if k in kept_names}
    return relax.Function(keep, func.body, func.ret_ty, func.is_pure, func.attrs), new_params


@dataclass
class _Fold:
    bn_var: relax.Var
    data_var: relax.Var  # conv output, or the bias add's output
    new_bias: relax.Var | None  # a new parameter when the conv had no bias
    channels: int
    axis: int
    ndim: int
    weight_name: str
    dead: list[relax.Var]  # unused reads of the batch norm's other outputs
    # bindings whose call arguments are replaced: var -> {argument index: new expression}
    arg_replace: dict[relax.Var, dict[int, relax.Expr]] = field(default_factory=dict)


def _out_channel_axis(layout: str) -> int | None:
    return layout.index("C") if "C" in layout and layout.count("C") == 1 else None


@relax.expr_functor.mutator
class _FoldMutator(relax.PyExprMutator):
    def __init__(self, folds: list[_Fold], mod=None):
        super().__init__(mod)
        self.by_bn = {f.bn_var: f for f in folds}
        self.drop = set(self.by_bn)
        for f in folds:
            self.drop.update(f.dead)
        self.arg_replace: dict[relax.Var, dict[int, relax.Expr]] = {}
        for f in folds:
            self.arg_replace.update(f.arg_replace)

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        tup = op.tuple_value
        if isinstance(tup, relax.Var) and tup in self.by_bn and op.index == 0:
            f = self.by_bn[tup]
            data = self.visit_expr(f.data_var)
            if f.new_bias is None:
                return data
            shape = [1] * f.ndim
            shape[f.axis] = f.channels
            b = self.builder_.emit(relax.op.reshape(f.new_bias, shape))
            return relax.op.add(data, b)
        return super().visit_tuple_getitem_(op)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.drop:
            return
        repl = self.arg_replace.get(binding.var)
        if repl is not None:
            call = binding.value
            args = [repl.get(i, self.visit_expr(a)) for i, a in enumerate(call.args)]
            new = self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, new))
            return
        super().visit_var_binding_(binding)


@relax.expr_functor.mutator
class _RebindMutator(relax.PyExprMutator):
    def __init__(self, values: dict, drop: set, mod=None):
        super().__init__(mod)
        self.values = values
        self.drop = drop

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.drop:
            return
        if binding.var in self.values:
            new = self.builder_.normalize(self.visit_expr(self.values[binding.var]))
            self.builder_.emit_normalized(relax.VarBinding(binding.var, new))
            return
        super().visit_var_binding_(binding)


def rebind(func: relax.Function, values: dict, drop=()) -> relax.Function:
    """Replace the values of some bindings of ``func`` (same vars, same types) and drop others.

    ``values`` maps a bound var to its new value (which may use any var bound before it);
    ``drop`` lists bindings to remove (nothing may use them any more).
    """
    if not values and not drop:
        return func
    return _RebindMutator(dict(values), set(drop)).visit_expr(func)


def _fresh_name(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def _bias_param_name(weight_name: str, taken: set[str]) -> str:
    if weight_name.endswith("weight"):
        base = weight_name[: -len("weight")] + "bias"
    else:
        base = f"{weight_name}.bias"
    return _fresh_name(base, taken)


def _finish(mod, func_name: str, func: relax.Function, after: dict, params: dict):
    """Put each new parameter right after the one named in ``after`` (parameters then read
    layer by layer), drop unused parameters, and return the updated module and params."""
    ordered = []
    for p in func.params:
        ordered.append(p)
        if p.name in after:
            ordered.append(after[p.name])
    func = relax.Function(ordered, func.body, func.ret_ty, func.is_pure, func.attrs)
    func, params = drop_unused_params(func, params)
    return with_main(mod, func, func_name), params


def _scan(mod: tvm.IRModule, params: dict, func_name: str):
    """What both folding passes read: numpy params, the function, each bound var's value,
    each var's users, the weight parameters (var -> name) and the taken parameter names."""
    params = {k: _as_numpy(v) for k, v in params.items()}
    func = mod[func_name]
    bindings = _flatten(func)
    value_of = {b.var: b.value for b in bindings if isinstance(b, relax.VarBinding)}
    users = _uses(func, bindings)
    pvar = {p: p.name for p in func.params if p.name in params}
    taken = {p.name for p in func.params}
    return params, func, value_of, users, pvar, taken


def fold_batch_norm(
    mod: tvm.IRModule, params: dict, func_name: str = "main"
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Fold ``nn.batch_norm`` (inference mode) into the preceding convolution.

    ``params`` maps parameter names of ``mod[func_name]`` to arrays (numpy or tvm tensors).
    Returns a new module and a new params dict (numpy arrays); the inputs are not modified.
    See the module docstring for exactly what is folded and how parameters are named.
    """
    params, func, value_of, users, pvar, taken = _scan(mod, params, func_name)

    def only_user(var, user) -> bool:
        return users.get(var, []) == [user]

    def value_array(expr) -> np.ndarray | None:
        """Array of a param or constant operand, through reshape/expand_dims bindings."""
        if isinstance(expr, relax.Var) and expr in pvar:
            return params[pvar[expr]]
        arr = _const_array(expr)
        if arr is not None:
            return arr
        if isinstance(expr, relax.Var) and _op_name(value_of.get(expr)) in _RESHAPE_OPS:
            inner = value_array(value_of[expr].args[0])
            shape = _shape(expr)
            if inner is not None and shape is not None:
                return inner.reshape(shape)
        return None

    folds: list[_Fold] = []
    updates: dict[str, np.ndarray] = {}
    for bn_var, call in list(value_of.items()):
        if _op_name(call) != "relax.nn.batch_norm" or bool(call.attrs.training):
            continue
        # every user must take the normalized tensor (item 0); unused reads of the running
        # statistics (the ONNX importer emits them) are dropped with the batch norm
        bn_users = users.get(bn_var, [])
        dead = [
            u
            for u in bn_users
            if u is not None
            and isinstance(value_of.get(u), relax.TupleGetItem)
            and value_of[u].index != 0
            and not users.get(u)
        ]
        if not bn_users or any(
            u not in dead
            and (
                u is None
                or not (isinstance(value_of.get(u), relax.TupleGetItem) and value_of[u].index == 0)
            )
            for u in bn_users
        ):
            continue
        data = call.args[0]
        if not isinstance(data, relax.Var) or data not in value_of or not only_user(data, bn_var):
            continue
        # optional bias add between the convolution and the batch norm
        bias_expr = None
        conv_var = data
        if _op_name(value_of[data]) == "relax.add":
            lhs, rhs = value_of[data].args
            for c, other in ((lhs, rhs), (rhs, lhs)):
                if isinstance(c, relax.Var) and _op_name(value_of.get(c)) in _CONV_OPS:
                    conv_var, bias_expr = c, other
                    break
            else:
                continue
            if not only_user(conv_var, data):
                continue
        conv = value_of.get(conv_var)
        op = _op_name(conv)
        if op not in _CONV_OPS:
            continue
        attrs = conv.attrs
        if _CONV_OPS[op] and int(attrs.groups) != 1:
            continue
        out_dtype = str(conv_var.ty.dtype) if isinstance(conv_var.ty, relax.TensorType) else ""
        if not out_dtype.startswith("float"):
            continue
        axis = _out_channel_axis(str(attrs.out_layout or attrs.data_layout))
        out_shape = _shape(conv_var)
        if axis is None or out_shape is None or int(call.attrs.axis) % len(out_shape) != axis:
            continue
        w = conv.args[1]
        if not isinstance(w, relax.Var) or w not in pvar or not only_user(w, conv_var):
            continue
        kernel_layout = str(attrs.kernel_layout)
        if kernel_layout.count("O") != 1:
            continue
        channels = out_shape[axis]
        stats = [value_array(a) for a in call.args[1:5]]
        if any(s is None or s.size != channels for s in stats):
            continue
        gamma, beta, mean, var = (s.reshape(channels).astype(np.float64) for s in stats)
        if not bool(call.attrs.scale):
            gamma = np.ones(channels)
        if not bool(call.attrs.center):
            beta = np.zeros(channels)

        bias = np.zeros(channels)
        fold = _Fold(bn_var, data, None, channels, axis, len(out_shape), pvar[w], dead)
        bias_param = None
        if bias_expr is not None:
            barr = value_array(bias_expr)
            if barr is None or barr.ndim > len(out_shape):
                continue
            bshape = (1,) * (len(out_shape) - barr.ndim) + barr.shape
            if any(d != 1 for i, d in enumerate(bshape) if i != axis):
                continue
            if barr.size not in (1, channels):
                continue
            bias = np.broadcast_to(barr.reshape(-1), (channels,)).astype(np.float64)
            # the bias is a parameter, possibly reshaped by bindings used only here ...
            root, user, ok = bias_expr, data, True
            while isinstance(root, relax.Var) and root not in pvar:
                if not only_user(root, user) or _op_name(value_of.get(root)) not in _RESHAPE_OPS:
                    ok = False
                    break
                user, root = root, value_of[root].args[0]
            if not ok:
                continue
            if isinstance(root, relax.Var):
                if not only_user(root, user) or params[pvar[root]].size != channels:
                    continue
                bias_param = pvar[root]
            elif _const_array(bias_expr) is not None:
                # ... or a constant operand of the add: replaced by the folded constant
                idx = next(i for i, a in enumerate(value_of[data].args) if a.same_as(bias_expr))
                const_shape = (*bshape[:axis], channels, *bshape[axis + 1 :])
            else:
                continue
        scale = gamma / np.sqrt(var + float(call.attrs.epsilon))
        new_bias_f64 = (bias - mean) * scale + beta
        wname = pvar[w]
        warr = params[wname]
        wshape = [1] * warr.ndim
        wshape[kernel_layout.index("O")] = channels
        updates[wname] = (warr.astype(np.float64) * scale.reshape(wshape)).astype(warr.dtype)
        new_bias = new_bias_f64.astype(warr.dtype)
        if bias_param is not None:
            updates[bias_param] = new_bias.reshape(params[bias_param].shape)
        elif bias_expr is not None:
            const = relax.const(new_bias.reshape(const_shape), str(new_bias.dtype))
            fold.arg_replace[data] = {idx: const}
        else:
            name = _bias_param_name(wname, taken)
            nv = relax.Var(name, relax.TensorType([channels], str(warr.dtype)))
            updates[name] = new_bias
            fold.new_bias = nv
        folds.append(fold)

    if not folds:
        return mod, params
    new_params = dict(params)
    new_params.update(updates)
    mutated = _FoldMutator(folds).visit_expr(func)
    # new bias parameters go right after their weight, so parameters read layer by layer
    after = {f.weight_name: f.new_bias for f in folds if f.new_bias is not None}
    out, new_params = _finish(mod, func_name, mutated, after, new_params)
    # the folded batch norms leave aliases (``y = conv_out``) behind: remove them
    out = relax.transform.CanonicalizeBindings()(out)
    return out, new_params


_AFFINE_OPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide")


def fold_affine(
    mod: tvm.IRModule, params: dict, func_name: str = "main"
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Fold per-channel affine chains after a convolution into its weight and bias.

    Some exporters write batch norm (or a Caffe ``Scale`` layer) as elementwise ops:
    ``conv -> [+ bias] -> - mean -> * scale -> + shift``. When every operand is a per-channel
    parameter or constant (or a scalar) and every intermediate value has one user, the chain
    is an affine map ``a * conv(x, W) + b`` per output channel and equals
    ``conv(x, W * a) + b``. The chain is replaced by one bias add; the weight keeps its name,
    the bias reuses the chain's bias parameter if it had one (else a new ``<layer>.bias``).
    A chain that is only a bias add is left alone. Computed in float64.
    """
    params, func, value_of, users, pvar, taken = _scan(mod, params, func_name)

    def channel_vector(expr, ndim: int, axis: int, channels: int):
        """(vector of length channels, parameter name or None) for a per-channel operand."""
        if isinstance(expr, relax.Var) and expr in pvar:
            arr, name = params[pvar[expr]], pvar[expr]
        else:
            arr, name = _const_array(expr), None
            if arr is None and isinstance(expr, relax.Var):
                v = value_of.get(expr)  # reshape(param) bound just before, used only here
                if _op_name(v) in _RESHAPE_OPS and len(users.get(expr, [])) == 1:
                    inner = v.args[0]
                    if isinstance(inner, relax.Var) and inner in pvar:
                        if len(users.get(inner, [])) == 1 and _shape(expr) is not None:
                            arr = params[pvar[inner]].reshape(_shape(expr))
                            name = pvar[inner]
        if arr is None or arr.ndim > ndim or not np.issubdtype(arr.dtype, np.floating):
            return None
        full = (1,) * (ndim - arr.ndim) + arr.shape
        if any(d != 1 for i, d in enumerate(full) if i != axis) or full[axis] not in (1, channels):
            return None
        if name is not None and len(users.get(expr, [])) != 1:
            return None
        vec = np.broadcast_to(arr.reshape(-1).astype(np.float64), (channels,))
        return vec, name

    values: dict[relax.Var, relax.Expr] = {}
    drop: set[relax.Var] = set()
    updates: dict[str, np.ndarray] = {}
    new_vars: list[tuple[str, relax.Var]] = []
    for conv_var, conv in value_of.items():
        op = _op_name(conv)
        if op not in _CONV_OPS or (_CONV_OPS[op] and int(conv.attrs.groups) != 1):
            continue
        w = conv.args[1]
        if not isinstance(w, relax.Var) or w not in pvar or users.get(w) != [conv_var]:
            continue
        axis = _out_channel_axis(str(conv.attrs.out_layout or conv.attrs.data_layout))
        shape = _shape(conv_var)
        kernel_layout = str(conv.attrs.kernel_layout)
        if axis is None or shape is None or kernel_layout.count("O") != 1:
            continue
        if not str(conv_var.ty.dtype).startswith("float"):
            continue
        channels = shape[axis]
        a, b = np.ones(channels), np.zeros(channels)
        chain: list[relax.Var] = []
        bias_name = None
        kinds = []
        cur = conv_var
        while True:
            us = users.get(cur, [])
            if len(us) != 1 or us[0] is None or _op_name(value_of.get(us[0])) not in _AFFINE_OPS:
                break
            nxt = us[0]
            call = value_of[nxt]
            if _shape(nxt) != shape:
                break
            lhs, rhs = call.args
            x_left = lhs.same_as(cur)
            other = rhs if x_left else lhs
            got = channel_vector(other, len(shape), axis, channels)
            if got is None:
                break
            c, name = got
            kind = _op_name(call)
            if kind == "relax.add":
                b = b + c
                if name is not None and bias_name is None and not kinds:
                    bias_name = name  # the convolution's own bias
            elif kind == "relax.subtract":
                if x_left:
                    b = b - c
                else:
                    a, b = -a, c - b
            elif kind == "relax.multiply":
                a, b = a * c, b * c
            elif x_left and np.all(c != 0):
                a, b = a / c, b / c
            else:
                break
            kinds.append(kind)
            chain.append(nxt)
            cur = nxt
        if not chain or kinds == ["relax.add"]:
            continue
        wname = pvar[w]
        warr = params[wname]
        wshape = [1] * warr.ndim
        wshape[kernel_layout.index("O")] = channels
        updates[wname] = (warr.astype(np.float64) * a.reshape(wshape)).astype(warr.dtype)
        if bias_name is None:
            bias_name = _bias_param_name(wname, taken)
            bvar = relax.Var(bias_name, relax.TensorType([channels], str(warr.dtype)))
            new_vars.append((wname, bvar))
            updates[bias_name] = b.astype(warr.dtype)
        else:
            bvar = next(p for p in pvar if pvar[p] == bias_name)
            updates[bias_name] = b.astype(warr.dtype).reshape(params[bias_name].shape)
        bshape = [1] * len(shape)
        bshape[axis] = channels
        values[chain[-1]] = relax.op.add(conv_var, relax.op.reshape(bvar, bshape))
        for v in chain[:-1]:
            drop.add(v)
            # reshape bindings of the chain's operands go too (they were used only here)
            for arg in value_of[v].args:
                if isinstance(arg, relax.Var) and _op_name(value_of.get(arg)) in _RESHAPE_OPS:
                    drop.add(arg)
        for arg in value_of[chain[-1]].args:
            if isinstance(arg, relax.Var) and _op_name(value_of.get(arg)) in _RESHAPE_OPS:
                drop.add(arg)

    if not values:
        return mod, params
    new_params = dict(params)
    new_params.update(updates)
    func = rebind(func, values, drop)
    return _finish(mod, func_name, func, dict(new_vars), new_params)
