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

from autoq.ir.toolkit import bindings, const_array, op_name, shape_of, with_main

__all__ = [
    "drop_unused_params",
    "fold_affine",
    "fold_batch_norm",
    "outline_control_flow",
    "rebind",
    "rename_params",
]

_CONV_OPS = {
    "relax.nn.conv1d": False,
    "relax.nn.conv2d": False,
    "relax.nn.conv3d": False,
    "relax.nn.conv1d_transpose": True,
    "relax.nn.conv2d_transpose": True,
}
_RESHAPE_OPS = ("relax.reshape", "relax.expand_dims")


def _uses(func: relax.Function, pairs) -> dict[relax.Var, list]:
    """For every var, the list of its users: binding vars, or None for the function result.

    A var used twice by one expression (``add(x, x)``) appears twice.
    """
    users: dict[relax.Var, list] = {}

    def record(expr, user):
        parts = list(expr.args) if isinstance(expr, relax.Call) else [expr]
        for part in parts:
            for v in relax.analysis.free_vars(part):
                users.setdefault(v, []).append(user)

    for var, value in pairs:
        record(value, var)
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


@dataclass
class _Conv:
    """A foldable convolution: its output var, weight parameter and output-channel layout."""

    var: relax.Var
    weight: str  # parameter name
    axis: int  # output-channel axis of the result
    shape: tuple[int, ...]  # of the result
    weight_axis: int  # output-channel axis of the kernel

    @property
    def channels(self) -> int:
        return self.shape[self.axis]


@dataclass
class _Scan:
    """What both folding passes read: numpy params, the function, each bound var's value,
    each var's users, the weight parameters (var -> name) and the taken parameter names."""

    params: dict[str, np.ndarray]
    func: relax.Function
    value_of: dict
    users: dict[relax.Var, list]
    pvar: dict[relax.Var, str]
    taken: set[str]

    def only_user(self, var, user) -> bool:
        return self.users.get(var, []) == [user]

    def is_reshape(self, var) -> bool:
        return isinstance(var, relax.Var) and op_name(self.value_of.get(var)) in _RESHAPE_OPS

    def value_array(self, expr) -> np.ndarray | None:
        """Array of a param or constant operand, through reshape/expand_dims bindings."""
        if isinstance(expr, relax.Var) and expr in self.pvar:
            return self.params[self.pvar[expr]]
        arr = const_array(expr)
        if arr is not None:
            return arr
        if self.is_reshape(expr):
            inner = self.value_array(self.value_of[expr].args[0])
            shape = shape_of(expr)
            if inner is not None and shape is not None:
                return inner.reshape(shape)
        return None

    def conv(self, var) -> _Conv | None:
        """``var`` as a foldable convolution: a float conv (transposed only with groups 1)
        with a known output-channel axis and shape, whose weight parameter it alone uses."""
        conv = self.value_of.get(var)
        op = op_name(conv)
        if op not in _CONV_OPS or (_CONV_OPS[op] and int(conv.attrs.groups) != 1):
            return None
        out_dtype = str(var.ty.dtype) if isinstance(var.ty, relax.TensorType) else ""
        axis = _out_channel_axis(str(conv.attrs.out_layout or conv.attrs.data_layout))
        shape = shape_of(var)
        kernel_layout = str(conv.attrs.kernel_layout)
        w = conv.args[1]
        if (
            not out_dtype.startswith("float")
            or axis is None
            or shape is None
            or kernel_layout.count("O") != 1
            or not (isinstance(w, relax.Var) and w in self.pvar and self.only_user(w, var))
        ):
            return None
        return _Conv(var, self.pvar[w], axis, shape, kernel_layout.index("O"))

    def scaled_weight(self, conv: _Conv, scale: np.ndarray) -> np.ndarray:
        """The weight times ``scale`` along its output channels (float64, then its dtype)."""
        warr = self.params[conv.weight]
        wshape = [1] * warr.ndim
        wshape[conv.weight_axis] = conv.channels
        return (warr.astype(np.float64) * scale.reshape(wshape)).astype(warr.dtype)

    def new_bias(self, conv: _Conv) -> relax.Var:
        """A new bias parameter for ``conv``, named after its weight."""
        name = _bias_param_name(conv.weight, self.taken)
        dtype = str(self.params[conv.weight].dtype)
        return relax.Var(name, relax.TensorType([conv.channels], dtype))


def _scan(mod: tvm.IRModule, params: dict, func_name: str) -> _Scan:
    params = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in params.items()}
    func = mod[func_name]
    pairs = bindings(func)
    pvar = {p: p.name for p in func.params if p.name in params}
    taken = {p.name for p in func.params}
    return _Scan(params, func, dict(pairs), _uses(func, pairs), pvar, taken)


# ----------------------------------------------------------------------------- batch norm


def fold_batch_norm(
    mod: tvm.IRModule, params: dict, func_name: str = "main"
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Fold ``nn.batch_norm`` (inference mode) into the preceding convolution.

    ``params`` maps parameter names of ``mod[func_name]`` to arrays (numpy or tvm tensors).
    Returns a new module and a new params dict (numpy arrays); the inputs are not modified.
    See the module docstring for exactly what is folded and how parameters are named.
    """
    scan = _scan(mod, params, func_name)
    folds: list[_Fold] = []
    updates: dict[str, np.ndarray] = {}
    for bn_var, call in list(scan.value_of.items()):
        if op_name(call) != "relax.nn.batch_norm" or bool(call.attrs.training):
            continue
        found = _batch_norm_fold(scan, bn_var, call)
        if found is not None:
            folds.append(found[0])
            updates.update(found[1])

    if not folds:
        return mod, scan.params
    new_params = dict(scan.params)
    new_params.update(updates)
    mutated = _FoldMutator(folds).visit_expr(scan.func)
    # new bias parameters go right after their weight, so parameters read layer by layer
    after = {f.weight_name: f.new_bias for f in folds if f.new_bias is not None}
    out, new_params = _finish(mod, func_name, mutated, after, new_params)
    # the folded batch norms leave aliases (``y = conv_out``) behind: remove them
    out = relax.transform.CanonicalizeBindings()(out)
    return out, new_params


def _batch_norm_fold(scan: _Scan, bn_var, call):
    """``(fold, parameter updates)`` for one batch norm, or None when it is not foldable."""
    dead = _dead_statistics(scan, bn_var)
    data = call.args[0]
    if dead is None or not (
        isinstance(data, relax.Var) and data in scan.value_of and scan.only_user(data, bn_var)
    ):
        return None
    below = _conv_and_bias(scan, data)
    conv = scan.conv(below[0]) if below is not None else None
    if conv is None or int(call.attrs.axis) % len(conv.shape) != conv.axis:
        return None
    stats = [scan.value_array(a) for a in call.args[1:5]]
    if any(s is None or s.size != conv.channels for s in stats):
        return None
    gamma, beta, mean, var = (s.reshape(conv.channels).astype(np.float64) for s in stats)
    if not bool(call.attrs.scale):
        gamma = np.ones(conv.channels)
    if not bool(call.attrs.center):
        beta = np.zeros(conv.channels)
    bias_expr = below[1]
    bias = (
        _Bias(np.zeros(conv.channels)) if bias_expr is None else _bias(scan, conv, data, bias_expr)
    )
    if bias is None:
        return None
    scale = gamma / np.sqrt(var + float(call.attrs.epsilon))
    fold = _Fold(bn_var, data, None, conv.channels, conv.axis, len(conv.shape), conv.weight, dead)
    updates = {conv.weight: scan.scaled_weight(conv, scale)}
    new_bias = ((bias.values - mean) * scale + beta).astype(updates[conv.weight].dtype)
    if bias.param is not None:
        updates[bias.param] = new_bias.reshape(scan.params[bias.param].shape)
    elif bias.const_arg is not None:
        idx, shape = bias.const_arg
        const = relax.const(new_bias.reshape(shape), str(new_bias.dtype))
        fold.arg_replace[data] = {idx: const}
    else:
        fold.new_bias = scan.new_bias(conv)
        updates[fold.new_bias.name] = new_bias
    return fold, updates


def _dead_statistics(scan: _Scan, bn_var) -> list | None:
    """The unused reads of the batch norm's running statistics (the ONNX importer emits them:
    they go with it), or None when a user takes anything but the normalized tensor."""
    bn_users = scan.users.get(bn_var, [])

    def index(u) -> int | None:
        v = scan.value_of.get(u)
        return v.index if isinstance(v, relax.TupleGetItem) else None

    dead = [u for u in bn_users if index(u) not in (None, 0) and not scan.users.get(u)]
    if not bn_users or any(u not in dead and index(u) != 0 for u in bn_users):
        return None
    return dead


def _conv_and_bias(scan: _Scan, data):
    """``(conv var, bias operand or None)`` under a batch norm's input: the convolution
    itself, or an ``add`` of it and a bias that only the batch norm reads."""
    value = scan.value_of[data]
    if op_name(value) != "relax.add":
        return data, None
    lhs, rhs = value.args
    for c, other in ((lhs, rhs), (rhs, lhs)):
        if isinstance(c, relax.Var) and op_name(scan.value_of.get(c)) in _CONV_OPS:
            return (c, other) if scan.only_user(c, data) else None
    return None


@dataclass
class _Bias:
    """The bias of a folded convolution: its values, and where the folded values go: a
    parameter (``param``), or a constant operand (``const_arg``: argument index, shape)."""

    values: np.ndarray
    param: str | None = None
    const_arg: tuple[int, tuple[int, ...]] | None = None


def _bias(scan: _Scan, conv: _Conv, data, bias_expr) -> _Bias | None:
    """The per-channel bias added between the convolution and the batch norm (``data`` is
    the add), or None when it is anything else."""
    barr = scan.value_array(bias_expr)
    ndim, axis, channels = len(conv.shape), conv.axis, conv.channels
    if barr is None or barr.ndim > ndim:
        return None
    bshape = (1,) * (ndim - barr.ndim) + barr.shape
    if any(d != 1 for i, d in enumerate(bshape) if i != axis) or barr.size not in (1, channels):
        return None
    values = np.broadcast_to(barr.reshape(-1), (channels,)).astype(np.float64)
    # the bias is a parameter, possibly reshaped by bindings used only here ...
    root, user = bias_expr, data
    while isinstance(root, relax.Var) and root not in scan.pvar:
        if not scan.only_user(root, user) or not scan.is_reshape(root):
            return None
        user, root = root, scan.value_of[root].args[0]
    if isinstance(root, relax.Var):
        if not scan.only_user(root, user) or scan.params[scan.pvar[root]].size != channels:
            return None
        return _Bias(values, param=scan.pvar[root])
    if const_array(bias_expr) is not None:
        # ... or a constant operand of the add: replaced by the folded constant
        idx = next(i for i, a in enumerate(scan.value_of[data].args) if a.same_as(bias_expr))
        return _Bias(values, const_arg=(idx, (*bshape[:axis], channels, *bshape[axis + 1 :])))
    return None


# --------------------------------------------------------------------------- affine chains

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
    scan = _scan(mod, params, func_name)
    values: dict[relax.Var, relax.Expr] = {}
    drop: set[relax.Var] = set()
    updates: dict[str, np.ndarray] = {}
    new_vars: list[tuple[str, relax.Var]] = []
    for conv_var in scan.value_of:
        conv = scan.conv(conv_var)
        chain = _affine_chain(scan, conv) if conv is not None else None
        if chain is None or not chain.vars or chain.kinds == ["relax.add"]:
            continue
        updates[conv.weight] = scan.scaled_weight(conv, chain.a)
        dtype = updates[conv.weight].dtype
        if chain.bias_name is None:
            bvar = scan.new_bias(conv)
            new_vars.append((conv.weight, bvar))
            updates[bvar.name] = chain.b.astype(dtype)
        else:
            bvar = next(p for p in scan.pvar if scan.pvar[p] == chain.bias_name)
            bias_shape = scan.params[chain.bias_name].shape
            updates[chain.bias_name] = chain.b.astype(dtype).reshape(bias_shape)
        bshape = [1] * len(conv.shape)
        bshape[conv.axis] = conv.channels
        values[chain.vars[-1]] = relax.op.add(conv_var, relax.op.reshape(bvar, bshape))
        drop.update(_chain_bindings(scan, chain.vars))

    if not values:
        return mod, scan.params
    new_params = dict(scan.params)
    new_params.update(updates)
    func = rebind(scan.func, values, drop)
    return _finish(mod, func_name, func, dict(new_vars), new_params)


@dataclass
class _Chain:
    """An affine chain ``a * conv + b`` after a convolution (per output channel)."""

    a: np.ndarray
    b: np.ndarray
    vars: list[relax.Var] = field(default_factory=list)  # the chain's bindings, in order
    kinds: list[str] = field(default_factory=list)  # their ops
    bias_name: str | None = None  # the convolution's own bias parameter, if the chain adds one


def _affine_chain(scan: _Scan, conv: _Conv) -> _Chain:
    """Follow single-user add/subtract/multiply/divide bindings with per-channel operands."""
    chain = _Chain(np.ones(conv.channels), np.zeros(conv.channels))
    cur = conv.var
    while True:
        us = scan.users.get(cur, [])
        if len(us) != 1 or us[0] is None or op_name(scan.value_of.get(us[0])) not in _AFFINE_OPS:
            break
        nxt = us[0]
        call = scan.value_of[nxt]
        if shape_of(nxt) != conv.shape:
            break
        lhs, rhs = call.args
        x_left = lhs.same_as(cur)
        got = _channel_vector(scan, rhs if x_left else lhs, conv)
        if got is None or not _apply(chain, op_name(call), x_left, *got):
            break
        chain.kinds.append(op_name(call))
        chain.vars.append(nxt)
        cur = nxt
    return chain


def _apply(chain: _Chain, kind: str, x_left: bool, c: np.ndarray, name: str | None) -> bool:
    """Compose one affine op with operand ``c`` into ``chain`` (False: not affine in x)."""
    a, b = chain.a, chain.b
    if kind == "relax.add":
        b = b + c
        if name is not None and chain.bias_name is None and not chain.kinds:
            chain.bias_name = name  # the convolution's own bias
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
        return False
    chain.a, chain.b = a, b
    return True


def _channel_vector(scan: _Scan, expr, conv: _Conv):
    """(vector of length channels, parameter name or None) for a per-channel operand."""
    ndim, axis, channels = len(conv.shape), conv.axis, conv.channels
    if isinstance(expr, relax.Var) and expr in scan.pvar:
        arr, name = scan.params[scan.pvar[expr]], scan.pvar[expr]
    else:
        arr, name = const_array(expr), None
        if arr is None and scan.is_reshape(expr) and len(scan.users.get(expr, [])) == 1:
            inner = scan.value_of[expr].args[0]  # reshape(param) bound just before, used only here
            if isinstance(inner, relax.Var) and inner in scan.pvar:
                if len(scan.users.get(inner, [])) == 1 and shape_of(expr) is not None:
                    arr = scan.params[scan.pvar[inner]].reshape(shape_of(expr))
                    name = scan.pvar[inner]
    if arr is None or arr.ndim > ndim or not np.issubdtype(arr.dtype, np.floating):
        return None
    full = (1,) * (ndim - arr.ndim) + arr.shape
    if any(d != 1 for i, d in enumerate(full) if i != axis) or full[axis] not in (1, channels):
        return None
    if name is not None and len(scan.users.get(expr, [])) != 1:
        return None
    vec = np.broadcast_to(arr.reshape(-1).astype(np.float64), (channels,))
    return vec, name


def _chain_bindings(scan: _Scan, chain: list[relax.Var]) -> set[relax.Var]:
    """What goes with a folded chain: its bindings but the last (which is rebound), and the
    reshape bindings of the operands (they were used only here)."""
    out = set(chain[:-1])
    for v in chain:
        out.update(a for a in scan.value_of[v].args if scan.is_reshape(a))
    return out


def outline_control_flow(mod: tvm.IRModule, func_name: str = "main") -> tvm.IRModule:
    """``mod`` with every ``If`` binding of ``func_name`` moved into a private function of
    its own (``<func>_branch_<k>``, called with the ``If``'s free variables), so that the
    function is a straight list of calls: the quantizer then sees one opaque fp32 layer
    where the control flow was, quantizes around it, and the module still builds (an
    ``If`` left inline would be cut apart by the binding slices). ``mod`` itself when there
    is none. An ``If`` whose condition the user can fix is better folded at import
    (``from_onnx(..., constant_inputs=...)``)."""
    func = mod[func_name]
    body = func.body
    if not isinstance(body, relax.SeqExpr) or not any(
        isinstance(b.value, relax.If) for block in body.blocks for b in block.bindings
    ):
        return mod
    bb = relax.BlockBuilder(mod)
    blocks, k = [], 0
    for block in body.blocks:
        new = []
        for b in block.bindings:
            if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.If):
                free = list(relax.analysis.free_vars(b.value))
                branch = relax.utils.copy_with_new_vars(relax.Function(free, b.value, b.var.ty))
                gv = bb.add_func(branch, f"{func_name}_branch_{k}")
                k += 1
                new.append(relax.VarBinding(b.var, relax.Call(gv, free)))
            else:
                new.append(b)
        blocks.append(relax.BindingBlock(new))
    out = bb.get()
    out[func_name] = relax.Function(
        func.params, relax.SeqExpr(blocks, body.body), func.ret_ty, func.is_pure, func.attrs
    )
    return relax.transform.Normalize()(out)
