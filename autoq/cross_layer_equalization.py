"""Cross-layer equalization of a float Relax model before calibration (``Config.equalization``).

Nagel, van Baalen, Blankevoort, Welling 2019, "Data-Free Quantization Through Weight
Equalization and Bias Correction" (ICCV; "DFQ"), sec. 4.1. The numpy math is
:mod:`autoq.equalize`; this module finds where it applies in a graph and rewrites the weights.

:func:`equalize_layers` finds chains of convolutions ``conv -> [+ bias] -> [relu] -> conv ->
...`` and rescales each intermediate channel ``i``: ``W1[i] /= s_i``, ``b1[i] /= s_i``,
``W2[:, i] *= s_i`` with DFQ's ``s_i = sqrt(r1_i r2_i) / r2_i`` (iterated along the chain,
:func:`autoq.equalize.equalize_chain`). The float function is unchanged up to float rounding
because ``relu(z / s) = relu(z) / s`` for ``s > 0`` (and the identity trivially; zero padding
of the second convolution too).

Decisions:

* **Exact or untouched.** A link ``A -> B`` is equalized only when: ``A`` and ``B`` are
  float ``conv1d/2d/3d`` (any groups: depthwise too) with ``N C ...`` data and output layouts
  and ``O I ...`` kernels; each weight is a named parameter used by that convolution only,
  or a constant operand; ``A``'s bias (if any) is a per-channel parameter (possibly through
  a reshape used only there) or constant added to ``A``'s output; every value between the
  two has exactly one user and is not a function output; the activation between them is
  one of :data:`HOMOGENEOUS` or nothing; ``B`` reads the value as its data input. Anything
  else is left as it is and, when a convolution was nearly linked to another, reported in
  :attr:`EqualizationReport.skipped` with the reason.
* **ReLU6 / clip chains are skipped**, not rewritten: ``clip(z / s, 0, 6) != clip(z, 0, 6) / s``.
  The exact form needs per-channel bounds ``6 / s_i`` (:func:`autoq.equalize.scaled_bounds`),
  which no activation pattern matches; DFQ itself replaced ReLU6 by ReLU, which changes the
  float model (measured: EfficientNet-Lite0 top-1 agreement of the *float* model 0.175).
* **No high-bias absorption.** It is exact only where the pre-activation is known to stay
  above the absorbed constant; DFQ reads that from batch-norm statistics, which the
  importers have already folded away, and on observed data it is exact only on that data.
  Measured offline it did not help either (benchmarks/results/accuracy.md: int8 0.744 vs
  0.731 without it, both below no equalization).
* **Names and structure kept.** Parameter names, bindings and layer ids do not change: only
  the values of the weights and biases (and constant operands, rewritten in place).
  Computed in float64, stored in each tensor's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .equalize import equalize_chain
from .graph import index_function
from .prepare import rebind
from .toolkit import const_array, free_vars, op_name, shape_of, with_main

__all__ = ["HOMOGENEOUS", "EqualizationReport", "equalize_layers"]

#: activations allowed between two equalized layers: positively homogeneous per channel,
#: ``f(z / s) = f(z) / s`` for every ``s > 0`` (relax op -> name in the report)
HOMOGENEOUS = {"relax.nn.relu": "relu"}

_CONVS = ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d")
_RESHAPES = ("relax.reshape", "relax.expand_dims")


@dataclass(frozen=True)
class EqualizationReport:
    """What :func:`equalize_layers` did. ``pairs``: ``(first layer, second layer,
    activation)`` of every equalized link (``"none"``: nothing between them), in graph
    order; ``chains``: the layers of each chain equalized together; ``skipped``:
    ``(layer, reason)`` for each convolution that feeds another one but was left alone."""

    pairs: tuple[tuple[str, str, str], ...] = ()
    chains: tuple[tuple[str, ...], ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()

    def summary(self) -> str:
        """One line: counts, and the skip reasons grouped.

        >>> EqualizationReport(pairs=(("a", "b", "relu"),), chains=(("a", "b"),),
        ...                    skipped=(("c", "clip"), ("d", "clip"))).summary()
        'equalized 1 layer pair(s) in 1 chain(s); skipped 2: clip (c, d)'
        """
        text = f"equalized {len(self.pairs)} layer pair(s) in {len(self.chains)} chain(s)"
        if not self.skipped:
            return text
        by: dict[str, list[str]] = {}
        for layer, why in self.skipped:
            by.setdefault(why, []).append(layer)
        groups = "; ".join(f"{why} ({', '.join(ls)})" for why, ls in by.items())
        return f"{text}; skipped {len(self.skipped)}: {groups}"


@dataclass
class _Tensor:
    """A weight or bias: its values (as the layer reads them) and where they are stored: a
    parameter (``param``, stored with ``stored_shape``) or a constant operand ``site`` =
    (binding var, argument index)."""

    array: np.ndarray
    param: str | None = None
    site: tuple[relax.Var, int] | None = None
    stored_shape: tuple[int, ...] = ()


@dataclass
class _Layer:
    var: relax.Var  # the convolution's binding
    name: str
    weight: _Tensor
    groups: int
    bias: _Tensor | None = None


class _Scan:
    """The function's bindings, users and weight parameters (read once)."""

    def __init__(self, func: relax.Function, params: dict[str, np.ndarray]):
        g = index_function(func, params)
        self.params = params
        self.value_of = g.value
        self.order = [v for v, _ in g.bindings]
        self.pvar = {p: p.name for p in g.weight_params}
        self.users: dict[relax.Var, list] = {v: list(us) for v, us in g.users.items()}
        for v in g.output_vars():
            self.users.setdefault(v, []).append(None)  # a function output

    def only_user(self, var) -> relax.Var | None:
        us = self.users.get(var, [])
        return us[0] if len(us) == 1 else None

    def tensor(self, expr, user) -> _Tensor | None:
        """A weight operand of binding ``user``: a parameter or a constant that only it
        reads, possibly through reshape bindings (or a reshape of a parameter written
        inside its call) that only it reads. The values come in ``expr``'s shape."""
        shape = shape_of(expr)
        while not (isinstance(expr, relax.Var) and expr in self.pvar):
            arr = const_array(expr)
            if arr is not None and shape is not None and arr.size == int(np.prod(shape)):
                args = self.value_of[user].args
                idx = next((i for i, a in enumerate(args) if a.same_as(expr)), None)
                if idx is None:  # a constant inside a nested call: not rewritten
                    return None
                return _Tensor(arr.reshape(shape), site=(user, idx), stored_shape=arr.shape)
            if isinstance(expr, relax.Call) and op_name(expr) in _RESHAPES:
                expr = expr.args[0]  # reshape(param) written inside the user's call
                continue
            if not isinstance(expr, relax.Var) or self.users.get(expr) != [user]:
                return None
            if op_name(self.value_of.get(expr)) not in _RESHAPES:
                return None
            user, expr = expr, self.value_of[expr].args[0]
        if self.users.get(expr) != [user] or shape is None:
            return None
        stored = self.params[self.pvar[expr]]
        if stored.size != int(np.prod(shape)):
            return None
        return _Tensor(stored.reshape(shape), self.pvar[expr], stored_shape=stored.shape)


def _operands(value) -> list[relax.Var]:
    """The vars a binding reads, once per argument (``add(x, x)`` reads x twice)."""
    parts = list(value.args) if isinstance(value, relax.Call) else [value]
    return [v for part in parts for v in free_vars(part)]


def _conv_layer(scan: _Scan, var) -> tuple[_Layer | None, str]:
    """``var`` as an equalizable convolution, or (None, why not)."""
    call = scan.value_of.get(var)
    if op_name(call) not in _CONVS:
        return None, "not a convolution"
    a = call.attrs
    layouts = (str(a.data_layout), str(a.out_layout or a.data_layout), str(a.kernel_layout))
    dtype = str(var.ty.dtype) if isinstance(var.ty, relax.TensorType) else ""
    if not dtype.startswith("float") or layouts[0] != layouts[1] or layouts[0][:2] != "NC":
        return None, f"layout {layouts[0]}/{layouts[1]} {dtype} (needs float N C ...)"
    if layouts[2][:2] != "OI":
        return None, f"kernel layout {layouts[2]} (needs O I ...)"
    w = scan.tensor(call.args[1], var)
    if w is None:
        return None, "weight shared or computed (needs a parameter only it reads, or a constant)"
    name = w.param or var.name
    return _Layer(var, name, w, int(a.groups)), ""


def _bias(scan: _Scan, add_var, out, channels: int) -> _Tensor | None:
    """The per-channel bias ``add_var`` adds to ``out`` (channels on axis 1; None: it is
    something else)."""
    call = scan.value_of.get(add_var)
    if op_name(call) != "relax.add":
        return None
    lhs, rhs = call.args
    other = rhs if lhs.same_as(out) else lhs if rhs.same_as(out) else None
    if other is None or other.same_as(out):
        return None
    t = scan.tensor(other, add_var)
    ndim = len(shape_of(out) or ())
    if t is None or t.array.ndim > ndim or not np.issubdtype(t.array.dtype, np.floating):
        return None
    full = (1,) * (ndim - t.array.ndim) + t.array.shape
    want = tuple(channels if i == 1 else 1 for i in range(ndim))
    return t if full == want else None


@dataclass
class _Link:
    second: relax.Var  # the next convolution
    value: relax.Var  # what it reads (the first layer's output, biased, activated)
    activation: str


def _follow(scan: _Scan, layer: _Layer, channels: int):
    """From ``layer``'s output to the next convolution: ``(link, bias, "")``, or ``(None,
    None, reason)`` when something in between prevents it (reason "" when no convolution
    follows at all)."""
    cur, bias, act = layer.var, None, "none"
    while True:
        users = scan.users.get(cur, [])
        if len(users) != 1 or users[0] is None:
            near = any(u is not None and op_name(scan.value_of[u]) in _CONVS for u in users)
            kinds = sorted({_short(None if u is None else scan.value_of[u]) for u in users})
            return None, None, (f"{len(users)} users ({', '.join(kinds)})" if near else "")
        user = users[0]
        value = scan.value_of[user]
        if op_name(value) in _CONVS:
            return _Link(user, cur, act), bias, ""
        if op_name(value) == "relax.add" and bias is None and act == "none":
            bias = _bias(scan, user, cur, channels)
            if bias is not None:
                cur = user
                continue
        if op_name(value) in HOMOGENEOUS and act == "none":
            act, cur = HOMOGENEOUS[op_name(value)], user
            continue
        nxt = scan.only_user(user)
        if nxt is None or op_name(scan.value_of[nxt]) not in _CONVS:
            return None, None, ""
        if len(_operands(value)) > 1:
            return None, None, f"{_short(value)} with another value between the layers"
        return None, None, f"{_short(value)} between the layers (not positively homogeneous)"


def _short(value) -> str:
    """``relax.nn.relu`` -> ``nn.relu``; None -> ``output``."""
    return "output" if value is None else op_name(value).removeprefix("relax.")


def _links(scan: _Scan):
    """Every equalizable link ``A -> B`` as ``{A var: (A layer, B var, activation)}``, the
    layers by var, and the skipped convolutions ``(name, reason)``."""
    layers: dict[relax.Var, _Layer] = {}
    links: dict[relax.Var, _Link] = {}
    skipped: list[tuple[str, str]] = []
    for var in scan.order:
        layer, _ = _conv_layer(scan, var)
        if layer is not None:
            layers[var] = layer
    for var, layer in layers.items():
        channels = layer.weight.array.shape[0]
        link, bias, why = _follow(scan, layer, channels)
        if link is None:
            if why:
                skipped.append((layer.name, why))
            continue
        why = _second_problem(scan, layers, link, channels)
        if why:
            skipped.append((layer.name, why))
            continue
        layer.bias = bias
        links[var] = link
    return layers, links, skipped


def _second_problem(scan: _Scan, layers: dict, link: _Link, channels: int) -> str:
    """Why the convolution a link reaches cannot take the scales ("" when it can)."""
    second = layers.get(link.second)
    if second is None:
        return "next convolution: " + _conv_layer(scan, link.second)[1]
    reads_data = scan.value_of[link.second].args[0].same_as(link.value)
    w = second.weight.array
    if not reads_data or w.shape[1] * second.groups != channels:
        return "the next convolution does not read the value as its data input"
    return ""


def _chains(layers: dict, links: dict[relax.Var, _Link]) -> list[list[_Layer]]:
    """Maximal paths of links, each a list of layers (first layer first)."""
    seconds = {lk.second for lk in links.values()}
    out = []
    for var in layers:
        if var not in links or var in seconds:
            continue
        chain = [layers[var]]
        while chain[-1].var in links:
            chain.append(layers[links[chain[-1].var].second])
        out.append(chain)
    return out


def equalize_layers(
    mod: tvm.IRModule, params: dict | None, func_name: str = "main"
) -> tuple[tvm.IRModule, dict[str, np.ndarray], EqualizationReport]:
    """Cross-layer equalization of ``mod[func_name]`` (see the module docstring).

    ``params`` maps parameter names to arrays (numpy or tvm tensors; None when the weights
    are constants). Returns the module (itself when only parameters changed), the new params
    (numpy, inputs not modified) and an :class:`EqualizationReport`.
    """
    params = {
        k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in (params or {}).items()
    }
    func = mod[func_name]
    if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
        return mod, params, EqualizationReport()
    scan = _Scan(func, params)
    layers, links, skipped = _links(scan)
    chains = _chains(layers, links)
    new_params = dict(params)
    consts: dict[relax.Var, dict[int, np.ndarray]] = {}
    for chain in chains:
        ws, bs, _ = equalize_chain(
            [lay.weight.array for lay in chain],
            [None if lay.bias is None else lay.bias.array.reshape(-1) for lay in chain],
            [lay.groups for lay in chain],
        )
        for k, lay in enumerate(chain):
            _store(lay.weight, ws[k], new_params, consts)
            if k < len(chain) - 1 and lay.bias is not None:
                _store(lay.bias, bs[k].reshape(lay.bias.array.shape), new_params, consts)
    report = EqualizationReport(
        pairs=tuple(
            (layers[a].name, layers[lk.second].name, lk.activation) for a, lk in links.items()
        ),
        chains=tuple(tuple(lay.name for lay in c) for c in chains),
        skipped=tuple(skipped),
    )
    if consts:
        values = {}
        for var, repl in consts.items():
            call = scan.value_of[var]
            args = [relax.const(repl[i]) if i in repl else a for i, a in enumerate(call.args)]
            values[var] = relax.Call(call.op, args, call.attrs, call.ty_args)
        mod = with_main(mod, rebind(func, values), func_name)
    return mod, new_params, report


def _store(t: _Tensor, values: np.ndarray, params: dict, consts: dict) -> None:
    values = np.asarray(values).astype(t.array.dtype).reshape(t.stored_shape)
    if t.param is not None:
        params[t.param] = values
    else:
        var, idx = t.site
        consts.setdefault(var, {})[idx] = values
