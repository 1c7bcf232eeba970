"""Stage 3, realize: the integer graph.

1. Every match is emitted by its pattern's ``realize`` callback: ``qnn.quantize`` on
   activations entering affine space, int8 weight and int32 bias *constants* (computed in
   numpy here, never at run time; or taken unchanged from ``qparams.values`` when a
   pre-quantized source fixed them, see :func:`autoq.import_quantized`), the ``qnn.*`` op,
   and ``qnn.dequantize`` leaving it.
2. :func:`propagate` moves ``qnn.quantize`` up and ``qnn.dequantize`` down through the
   ``commute`` ops of the allow-list (relu -> ``max(q, zp)``, clip in the integer domain,
   max-pool, reshape, ...), every move exact, then merges each ``qnn.dequantize ->
   qnn.quantize`` pair into ``qnn.requantize`` (dropped when the qparams are equal).
3. Remaining fp32 parameters (of layers left in float) are bound as constants and unused
   bindings are removed: the result's ``main`` takes only the model's inputs.

In the default rounding mode the realized graph computes exactly what the calibrated
simulated graph computes (see docs/design.md, "Fidelity").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from autoq import primitives as P
from autoq import qnn
from autoq.config import Config
from autoq.ir.allow_list import ALLOW_LIST, AllowRule, Grid, grid_point
from autoq.ir.graph import Graph
from autoq.ir.matching import as_matched
from autoq.ir.registry import Match, slot_id_of
from autoq.ir.toolkit import (
    BindingWriter,
    bindings,
    const,
    const_array,
    dtype_of,
    free_vars,
    is_call,
    op_name,
    remap_expr,
    with_main,
)
from autoq.qparams import QParam, QParams
from autoq.realization.tflite_multipliers import layer_multiplier
from autoq.recipes import resolve
from autoq.rules import depthwise_channels, hybrid, lut_channels, residual_channels
from autoq.rules.exits import exit_tensors
from autoq.simulation import build_function

__all__ = ["RealizeContext", "explicit_multipliers", "finish_module", "propagate", "realize"]


class RealQ:
    """A quantized tensor of the realized graph: int values ``q`` and numpy qparams."""

    def __init__(self, ctx, q, qp: QParam):
        self._ctx, self.q, self.qparam = ctx, q, qp
        self.scale = qp.scale
        self.zero_point = qp.zero_point
        self.dtype = qp.dtype
        self.scale_c = const(qp.scale, "float32")
        self.zero_point_c = const(qp.zero_point, "int32")
        #: the ``axis`` attribute of its qnn quantize / dequantize (-1: per tensor)
        self.axis = -1 if qp.axis is None else qp.axis
        self._real = None

    @property
    def real(self) -> relax.Expr:
        if self._real is None:
            self._real = self._ctx.emit(
                qnn.dequantize(self.q, self.scale_c, self.zero_point_c, axis=self.axis)
            )
        return self._real


class RealizeContext:
    """What a pattern's ``realize`` callback can ask for (see autoq.ir.registry)."""

    def __init__(
        self,
        g: Graph,
        config: Config,
        qparams: QParams,
        matches: list[Match],
        rounding_points: dict | None = None,
        exits: dict | None = None,
        dynamic: frozenset[str] = frozenset(),
    ):
        self.g, self.config, self.qparams = g, config, qparams
        self.rounding = config.rounding
        self.writer = BindingWriter()
        self.vmap: dict = {}
        self.match: Match | None = None
        self.tensor_id = slot_id_of(g, matches)
        self._acts: dict[str, RealQ] = {}
        self.warnings: list[str] = []
        self._points = dict(rounding_points or {})
        self._rounded: dict = {}
        #: tensor -> producing layer, for the exit slots (see autoq.rules.exits)
        self.exits = dict(exits or {})
        self._dynamic: dict[tuple, hybrid.DynamicQ] = {}
        #: conv outputs quantized per channel for their lookup (autoq.rules.lut_channels)
        self.per_channel = lut_channels.per_channel_inputs(g, matches, config)
        #: depthwise inputs quantized per channel (autoq.rules.depthwise_channels)
        self.per_channel_dw = depthwise_channels.depthwise_inputs(g, matches, config)
        #: residual-stream tensors quantized per channel on their last axis
        self.channels = residual_channels.per_channel_slots(
            g, matches, config, dynamic, self.tensor_id
        )

    def _per_axis_ok(self, expr, qp: QParam) -> bool:
        """Whether ``expr``'s slot may have ``qp`` per axis (lookup and depthwise inputs on
        axis 1, the residual stream on its last axis)."""
        if expr in self.per_channel or expr in self.per_channel_dw:
            return qp.axis == lut_channels.AXIS
        return expr in self.channels and qp.axis == self.channels[expr][1]

    def emit(self, expr, name: str | None = None) -> relax.Var:
        return self.writer.emit(expr, name or "")

    def value(self, expr) -> relax.Expr:
        return remap_expr(expr, self.vmap)

    def copy(self, expr) -> relax.Expr:
        """A binding outside every match, its operands mapped: an operand with an exit slot
        is read through it, one that is a rounding point (see :func:`realize`) through its
        quantize -> dequantize pair."""
        local = dict(self.vmap)
        for u in free_vars(expr):
            if u in self.exits:
                local[u] = self.exit_real(u)
            elif u in self._points:
                local[u] = self._rounding_point(u)
        return remap_expr(expr, local)

    def copy_result(self, expr) -> relax.Expr:
        """The function's result: outputs with an exit slot are read through it."""
        local = {u: self.exit_real(u) for u in free_vars(expr) if u in self.exits}
        return remap_expr(expr, {**self.vmap, **local})

    def exit_real(self, var) -> relax.Expr:
        """``dequantize(quantize(var))`` with ``var``'s exit slot (autoq.rules.exits)."""
        prev, self.match = self.match, self.exits[var]
        try:
            return self.activation(var).real
        finally:
            self.match = prev

    def _rounding_point(self, u) -> relax.Expr:
        if u not in self._rounded:
            qp = self._points[u]
            s, z = const(qp.scale, "float32"), const(qp.zero_point, "int32")
            q = self.emit(qnn.quantize(self.value(u), s, z, out_dtype=qp.dtype))
            self._rounded[u] = self.emit(qnn.dequantize(q, s, z))
        return self._rounded[u]

    @property
    def layer(self) -> str:
        return self.match.layer if self.match is not None else ""

    def _qparam(self, sid: str) -> QParam:
        if sid not in self.qparams:
            raise KeyError(
                f"no qparams for slot {sid!r} (layer {self.layer}); the qparams do not belong to "
                "this model/config: calibrate again or add the slot"
            )
        return self.qparams[sid]

    def activation(self, expr) -> RealQ:
        sid = self.tensor_id(expr)
        if sid not in self._acts:
            qp = self._qparam(sid)
            if qp.per_axis and not self._per_axis_ok(expr, qp):
                raise ValueError(
                    f"activation slot {sid!r} has per-axis qparams (axis {qp.axis}); activations "
                    "are per-tensor (except lookup inputs with Config.rules 'lookup_per_channel', depthwise "
                    "inputs with Config.rules 'depthwise_per_channel' and the residual stream's last "
                    "axis with Config.rules 'residual_per_channel')"
                )
            r = self._acts[sid] = RealQ(self, None, qp.uniform())
            r.q = self.emit(
                qnn.quantize(
                    self.value(expr), r.scale_c, r.zero_point_c, axis=r.axis, out_dtype=qp.dtype
                ),
                f"{sid}.q",
            )
        return self._acts[sid]

    def dynamic_activation(self, expr) -> hybrid.DynamicQ:
        """``expr`` quantized at run time with the current layer's activation spec (dynamic
        layers, :mod:`autoq.realization.dynamic` / :mod:`autoq.rules.hybrid`); layers reading the same tensor
        with the same spec share one ``qnn.dynamic_quantize``."""
        spec = self.config.layer_spec("activation", self.layer, self.match.pattern.name)
        sid = self.tensor_id(expr)
        key = hybrid.dynamic_key(sid, spec)
        if key not in self._dynamic:
            dq = hybrid.emit_dynamic_quantize(self.emit, self.value(expr), spec, sid)
            self._dynamic[key] = dq
        return self._dynamic[key]

    def weight(self, expr, axis: int, transpose: tuple[int, ...] | None = None) -> RealQ:
        """int8 weight constant (quantized here in numpy, or taken as it is from
        ``qparams.values`` when the source fixed it); ``transpose`` re-lays it out."""
        sid = f"{self.layer}.weight"
        qp = self._qparam(sid)
        arr = np.asarray(self.g.weight_of(expr).array, np.float32)
        q = self._given(sid, arr.shape, (qp.dtype,))
        if q is None:
            q = P.quantize(arr, qp.scale, qp.zero_point, qp.dtype, qp.axis)
        if transpose is not None:
            q = np.ascontiguousarray(np.transpose(q, transpose))
            new_axis = None if qp.axis is None else list(transpose).index(qp.axis)
            qp = QParam(qp.scale, qp.zero_point, qp.dtype, new_axis, qp.rmin, qp.rmax)
        return RealQ(self, const(q), qp)

    def bias(
        self, expr, acc_scale: np.ndarray, out_shape: list[int], channel_axis: int
    ) -> relax.Expr:
        """int32 bias constant with scale ``acc_scale`` (= input scale * weight scale)."""
        arr = np.asarray(self.g.weight_of(expr).array, np.float32).reshape(-1)
        values = self._given(f"{self.layer}.bias", arr.shape, ("int32",))
        if values is None:
            # acc_scale is already the float32 product; quantize_bias recomputes it the same way
            r = P.quantize_bias(arr, np.float32(1.0), acc_scale)
            if r.saturated:
                msg = f"{self.layer}: {r.saturated} bias values saturate int32 (scale too small for the bias)"
                self.warnings.append(msg)
                warnings.warn(msg, stacklevel=2)
            values = r.values
        shape = [1] * len(out_shape)
        shape[channel_axis] = arr.size
        return const(values.reshape(shape), "int32")

    def _given(self, key: str, shape: tuple[int, ...], dtypes: tuple[str, ...]):
        """The integer tensor ``qparams.values[key]`` fixed by the source (a pre-quantized
        file), checked against the float tensor it replaces; None when there is none."""
        values = getattr(self.qparams, "values", None) or {}
        if key not in values:
            return None
        v = np.asarray(values[key])
        if tuple(v.shape) != tuple(shape) or str(v.dtype) not in dtypes:
            raise ValueError(
                f"qparams.values[{key!r}] is {v.dtype} {tuple(v.shape)}; the model needs "
                f"{' or '.join(dtypes)} {tuple(shape)}"
            )
        return v

    def output_qparam(self) -> RealQ:
        sid = self.match.layer
        return RealQ(self, None, self._qparam(sid))

    def output(self, y) -> relax.Expr:
        """Register the int result of the current match as its root tensor's quantized
        value and return its dequantized (float) form for the other consumers."""
        sid = self.match.layer
        qp = self._qparam(sid)
        if qp.per_axis and not self._per_axis_ok(self.match.root, qp):
            raise ValueError(
                f"output slot {sid!r} has per-axis qparams (axis {qp.axis}); outputs are "
                "per-tensor (except lookup outputs read by a depthwise conv with "
                "Config.rules 'depthwise_per_channel' and residual-stream adds with "
                "Config.rules 'residual_per_channel')"
            )
        r = self._acts[sid] = RealQ(self, self.emit(y, f"{sid}.q"), qp)
        return qnn.dequantize(r.q, r.scale_c, r.zero_point_c, axis=r.axis)


# --------------------------------------------------------------------------- propagation


def _per_tensor(e) -> bool:
    v = const_array(e)
    return v is not None and v.ndim == 0


@dataclass
class _Quantize:
    """A ``qnn.quantize`` with constant qparams being moved (``axis`` -1: per tensor)."""

    scale: relax.Expr
    zp: relax.Expr
    dtype: str
    axis: int = -1

    @staticmethod
    def of_call(call) -> _Quantize:
        axis = -1 if _per_tensor(call.args[1]) else int(call.attrs["axis"])
        return _Quantize(call.args[1], call.args[2], str(call.attrs["out_dtype"]), axis)

    def q(self, x):
        return qnn.quantize(x, self.scale, self.zp, axis=self.axis, out_dtype=self.dtype)

    @property
    def grid(self) -> Grid | None:
        """Its grid (per axis: one per channel, see :class:`Grid`); None for qparams that
        are not constants."""
        s, z = const_array(self.scale), const_array(self.zp)
        if s is None or z is None:
            return None
        if self.axis == -1:
            return Grid(int(z), self.dtype, grid_point(s, int(z), self.dtype))
        return Grid(z, self.dtype, grid_point(s, z, self.dtype), self.axis)

    def same_as_dequantize(self, deq) -> bool:
        w, s1, z1 = deq.args
        return (
            _per_tensor(s1) and _per_tensor(z1) and dtype_of(w) == self.dtype
            and float(const_array(s1)) == float(const_array(self.scale))
            and int(const_array(z1)) == int(const_array(self.zp))
        )  # fmt: skip


def _per_axis_requantize(value, src, rounding: str):
    """A per-axis ``qnn.quantize`` of a ``qnn.dequantize`` (per tensor, or per axis on the
    same axis) as one ``qnn.requantize`` (a conv's per-channel output grid for its lookup,
    :mod:`autoq.rules.lut_channels`); None otherwise."""
    axis = int(value.attrs["axis"])
    if axis != lut_channels.AXIS:
        return None  # (only RealizeContext.activation emits per-axis quantizes on axis 1)
    w, s1, z1 = src.args
    if not (_per_tensor(s1) or int(src.attrs["axis"]) == axis):
        return None
    _, s2, z2 = value.args
    out_dtype = str(value.attrs["out_dtype"])
    return qnn.requantize(w, s1, z1, s2, z2, axis=axis, out_dtype=out_dtype, rounding=rounding)


def propagate(mod: tvm.IRModule, rounding: str = "float", max_rounds: int = 1000) -> tvm.IRModule:
    """Push quantize up and dequantize down through the allow-list and merge them (module
    doc), to a fixed point."""
    func = mod["main"]
    for phase in ("up", "down"):
        for _ in range(max_rounds):
            func, changed = _Round(phase, rounding).run(func)
            if not changed:
                break
    return with_main(mod, func)


def _takes(rule: AllowRule, quant: _Quantize) -> bool:
    """Whether ``quant`` may move above an op of ``rule`` (per axis: only rows that say so)."""
    return quant.axis == -1 or rule.quantize_per_axis


class _Round:
    """One rewriting pass over ``main``'s bindings (phase "up" or "down")."""

    def __init__(self, phase: str, rounding: str):
        self.phase, self.rounding = phase, rounding
        self.w = BindingWriter()
        self.new_value: dict = {}

    def emit(self, expr, name: str = "") -> relax.Var:
        v = self.w.emit(expr, name)
        self.new_value[v] = self.w.lookup(v)
        return v

    def val(self, e):
        return self.new_value.get(e, e) if isinstance(e, relax.Var) else e

    def run(self, func: relax.Function):
        vmap: dict = {}
        changed = False
        for var, value in bindings(func):
            value = remap_expr(value, vmap)
            out = self.rewrite(value)
            changed |= out is not None
            if out is None:
                out = value
            vmap[var] = out if isinstance(out, relax.Var) else self.emit(out, var.name)
        new = self.w.finish(func.params, remap_expr(func.body.body, vmap), func.attrs)
        return relax.analysis.remove_all_unused(new), changed

    def rewrite(self, value):
        """The replacement of one binding's value, or None to keep it."""
        if is_call(value, "qnn.quantize"):
            return self.quantize(value)
        if self.phase == "down" and is_call(value) and value.args:
            return self.dequantize_below(value)
        return None

    def quantize(self, value):
        src = self.val(value.args[0])
        quant = _Quantize.of_call(value)
        if is_call(src, "qnn.dequantize") and quant.axis != -1:
            return _per_axis_requantize(value, src, self.rounding)
        if is_call(src, "qnn.dequantize"):
            if quant.same_as_dequantize(src):
                return src.args[0]
            w, s1, z1 = src.args
            axis = int(src.attrs["axis"])
            return qnn.requantize(
                w, s1, z1, quant.scale, quant.zp, axis=axis, out_dtype=quant.dtype,
                rounding=self.rounding,
            )  # fmt: skip
        if self.phase != "up":
            return None
        if isinstance(src, relax.TupleGetItem):
            tup = self.val(src.tuple_value)
            rule = ALLOW_LIST.get(op_name(tup))
            if rule is None or rule.operands != "tuple" or not _takes(rule, quant):
                return None
            qi = self.emit(quant.q(tup.args[0]))
            sp = self.emit(tvm.ir.Call(tup.op, [qi], tup.attrs))
            return relax.TupleGetItem(sp, src.index)
        rule = ALLOW_LIST.get(op_name(src))
        if rule is None or rule.kind != "commute" or rule.operands == "tuple":
            return None
        return self.move_above(src, rule, quant) if _takes(rule, quant) else None

    def move_above(self, src, rule: AllowRule, quant: _Quantize):
        grid = quant.grid
        if grid is None:
            return None
        if rule.operands == "fields":
            fields = self.val(src.args[0])
            if not isinstance(fields, relax.Tuple):
                return None
            return rule.integer(src, [self.emit(quant.q(f)) for f in fields.fields], grid)
        x = src.args[0]
        placeholder = relax.Var("x", relax.TensorType(None, quant.dtype))
        out = rule.integer(src, placeholder, grid)
        if out is None:
            return None
        if out is placeholder:  # the identity: the quantize takes the binding's place
            return quant.q(x)
        return remap_expr(out, {placeholder: self.emit(quant.q(x))})

    def dequantize_below(self, value):
        rule = ALLOW_LIST.get(op_name(value))
        src = self.val(value.args[0])
        if rule is None or rule.kind != "commute" or not rule.dequantize_below:
            return None
        if not is_call(src, "qnn.dequantize"):
            return None
        w, s, z = src.args
        zv = const_array(z)
        if zv is None:
            return None
        per_tensor = _per_tensor(s) and zv.ndim == 0
        uniform_zp = bool(np.all(zv == zv.reshape(-1)[0]))
        if not (per_tensor or (rule.dequantize_per_axis and uniform_zp)):
            return None
        iv = rule.integer(value, w, Grid(int(zv.reshape(-1)[0]), dtype_of(w)))
        if iv is None:
            return None
        wi = iv if iv is w else self.emit(iv)
        return qnn.dequantize(wi, s, z, axis=int(src.attrs["axis"]))


# ------------------------------------------------------------------------------ realize


def realize(
    model,
    params: dict | None,
    qparams: QParams,
    config: Config | None = None,
    *,
    rounding_points: dict | None = None,
    exits: bool | None = None,
) -> tvm.IRModule:
    """The int8 module for ``model`` with ``qparams`` (from :func:`autoq.calibration` or
    :func:`autoq.load_qparams`), using the same patterns and fallback as ``config``.

    ``model``: the fp32 ``IRModule`` (matched here), or the :class:`autoq.ir.matching.Matched`
    / :class:`autoq.simulation.SimResult` of it (its matches are reused, nothing is matched
    again; ``params`` is then ignored). ``rounding_points``: ``{tensor: QParam}`` for tensors
    (Vars of the prepared graph) that a pre-quantized source rounds: a binding outside the
    integer layers that reads one gets ``dequantize(quantize(tensor))`` with those qparams
    (see :mod:`autoq.import_quantized`); by default those ``model`` carries, if any (the
    ``float_mod`` of an import report). ``exits``: give every int32 result that a float op
    reads its exit slot (:mod:`autoq.rules.exits`), as :func:`autoq.simulation` does; default: yes,
    unless there are rounding points (a pre-quantized file fixes its own rounding)."""
    config = config or Config()
    if rounding_points is None:
        rounding_points = getattr(model, "rounding_points", None)
    if exits is None:
        exits = getattr(model, "exits", not rounding_points)
    matched = as_matched(model, params, config)
    g = matched.graph
    config = resolve(config, g)[0]
    matches = matched.active(config.fallback)
    hybrid.check_dynamic_layers(config, matches)
    dynamic = hybrid.dynamic_names(config, matches)
    exit_map = exit_tensors(g, matches, config.int8_outputs, dynamic) if exits else None
    ctx = RealizeContext(g, config, qparams, matches, rounding_points, exit_map, dynamic)
    callback = hybrid.callbacks(dynamic, "realize", "dynamic")
    func = build_function(g, ctx, matches, callback, desc="realize")
    out = propagate(with_main(g.module, func), config.rounding)
    return finish_module(g, explicit_multipliers(out["main"]))


def explicit_multipliers(func: relax.Function) -> relax.Function:
    """Every integer-rounding ``qnn.requantize`` with constant scales gets its int32
    multiplier and shift as constant arguments (:func:`autoq.qnn.with_multipliers`), so a
    backend reads them off the op; float-rounding requantizes are unchanged. In the
    ``tflite`` modes a requantize ending a layer gets the multiplier TFLite's kernel
    computes for it (:mod:`autoq.realization.tflite_multipliers`)."""
    values = dict(bindings(func))
    pattern = is_op("qnn.requantize")(*[wildcard() for _ in range(5)])

    def rewrite(call, _):
        if not is_call(call, "qnn.requantize"):
            return call
        return qnn.with_multipliers(call, layer_multiplier(call, values.get))

    return rewrite_call(pattern, rewrite, func)


def finish_module(g: Graph, func: relax.Function) -> tvm.IRModule:
    """The deployable module of a realized ``main``: the fp32 weight parameters (of layers
    left in float) bound as constants, unused bindings removed, ``main`` of the inputs."""
    if g.weight_params:
        bind = {p.name: tvm.runtime.tensor(g.params[p.name]) for p in g.weight_params}
        func = func.bind_params(bind)
        func = relax.Function(list(g.inputs), func.body, func.ret_ty, attrs=func.attrs)
    func = relax.analysis.remove_all_unused(func)
    result = with_main(g.module, func.with_attr("global_symbol", "main"))
    result = relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(result))
    return result
