"""What a pattern's ``simulate`` callback can ask for: :class:`SimContext` (activation
slots, weights, lookup tables, per-layer switches) and the :class:`SlotPlan` it fills."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq import qnn
from autoq.config import Config, QuantSpec
from autoq.ir.activations import LUT_DTYPES
from autoq.ir.graph import Graph, WeightRef
from autoq.ir.registry import Match, slot_id_of
from autoq.ir.toolkit import (
    BindingWriter,
    const,
    free_vars,
    is_call,
    remap_expr,
    shape_of,
)
from autoq.primitives import qrange
from autoq.qparams import SlotInfo
from autoq.rules import clip_ranges, depthwise_channels, hybrid, lut_channels, residual_channels
from autoq.rules.exits import int32_carriers

__all__ = ["SimContext", "SlotPlan"]


@dataclass
class SlotPlan:
    """What simulate decided about the slots, shared with calibrate and realize."""

    slots: dict[str, SlotInfo] = field(default_factory=dict)
    specs: dict[str, QuantSpec] = field(default_factory=dict)
    #: activation slot -> the tensor (Var of the prepared fp32 graph) it quantizes
    tensors: dict[str, relax.Var] = field(default_factory=dict)
    #: weight slot -> float array and its per-channel axis (None = per-tensor)
    weights: dict[str, tuple[np.ndarray, int | None]] = field(default_factory=dict)
    #: layer -> (input slot, output slot, activation) of its lookup table (autoq.ir.activations)
    tables: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    #: layer -> (flat float bias, input slot, weight slot) of a bias read as an input
    biases: dict[str, tuple[np.ndarray, str, str]] = field(default_factory=dict)
    #: layers whose input is quantized at run time (no input slot; :mod:`autoq.rules.hybrid`)
    dynamic: frozenset[str] = frozenset()


class _LazyQ:
    """Handles on one quantized tensor inside the simulated graph."""

    def __init__(self, ctx: SimContext, q, scale, zero_point, axis=None):
        self._ctx, self.q, self.scale, self.zero_point, self.axis = ctx, q, scale, zero_point, axis
        self._centered = None
        self._real = None

    @property
    def centered(self) -> relax.Expr:
        """``q - zero_point`` (integer-valued float32)."""
        if self._centered is None:
            one = const(1.0, "float32")
            ax = -1 if self.axis is None else self.axis
            self._centered = self._ctx.emit(
                qnn.simulated_dequantize(self.q, one, self.zero_point, axis=ax)
            )
        return self._centered

    @property
    def real(self) -> relax.Expr:
        """``(q - zero_point) * scale`` (float32 reals)."""
        if self._real is None:
            ax = -1 if self.axis is None else self.axis
            self._real = self._ctx.emit(
                qnn.simulated_dequantize(self.q, self.scale, self.zero_point, axis=ax)
            )
        return self._real


def _is_unswitched_sq(expr) -> bool:
    return is_call(expr, "qnn.simulated_quantize") and len(expr.args) == 3


def _with_switch(call, enable) -> relax.Expr:
    return tvm.ir.Call(call.op, [*call.args, enable], call.attrs, list(call.ty_args))


class SimContext:
    """What a pattern's ``simulate`` callback can ask for (see autoq.ir.registry)."""

    def __init__(
        self,
        g: Graph,
        config: Config,
        matches: list[Match],
        switches: bool = False,
        exits: dict | None = None,
    ):
        self.g, self.config = g, config
        #: tensor -> producing layer, for the exit slots (see autoq.rules.exits)
        self.exits = dict(exits or {})
        self.plan = SlotPlan(dynamic=hybrid.dynamic_names(config, matches))
        #: tensors carrying a layer's int32 result -> that layer (switch mode, see below)
        self.carriers = int32_carriers(g, matches, self.plan.dynamic) if switches else {}
        self.switches = switches
        #: layer -> its ``<layer>.enable`` parameter (switch mode only)
        self.switch_vars: dict[str, relax.Var] = {}
        #: layer -> the slots it reads or writes (activations, weight, output), in order
        self.layer_slots: dict[str, list[str]] = {}
        self.writer = BindingWriter()
        self.vmap: dict = {}
        self.qparam_vars: dict[str, tuple[relax.Var, relax.Var]] = {}
        #: layer -> its ``<layer>.table`` input (lookup-table activations)
        self.table_vars: dict[str, relax.Var] = {}
        self.sq_vars: dict[str, relax.Var] = {}
        #: ``<layer>.weight`` / ``<layer>.bias`` -> the input holding its (tuned) float value
        self.value_vars: dict[str, relax.Var] = {}
        self._acts: dict[str, _LazyQ] = {}
        self._dynamic: dict[tuple, hybrid.SimulatedDynamicQ] = {}
        self.match: Match | None = None
        self.tensor_id = slot_id_of(g, matches)
        self._consumer: dict[str, str] = {}
        #: conv outputs quantized per channel for their lookup (autoq.rules.lut_channels)
        self.per_channel = lut_channels.per_channel_inputs(g, matches, config)
        #: depthwise inputs (axis 1) and residual-stream tensors (last axis) per channel
        self.per_channel_dw = depthwise_channels.depthwise_inputs(g, matches, config)
        #: clip (ReLU6) outputs, calibrated by min / max (autoq.rules.clip_ranges)
        self.clipped = clip_ranges.clipped_tensors(g, config)
        self.channels = residual_channels.per_channel_slots(
            g, matches, config, self.plan.dynamic, self.tensor_id
        )

    def channel_slot(self, expr) -> tuple[int | None, int | None]:
        """(channels, axis) of ``expr``'s per-channel slot, (None, None) per tensor."""
        for table in (self.per_channel, self.per_channel_dw):
            if expr in table:
                return table[expr][0], lut_channels.AXIS
        return self.channels.get(expr, (None, None))

    # ---- generic
    def emit(self, expr, name: str | None = None, switch=None) -> relax.Var:
        if self.switches and self.match is not None and _is_unswitched_sq(expr):
            expr = _with_switch(expr, switch if switch is not None else self._switch())
        return self.writer.emit(expr, name or "")

    def _switch(self, layer: str | None = None) -> relax.Var:
        layer = layer or self.layer
        if layer not in self.switch_vars:
            self.switch_vars[layer] = relax.Var(f"{layer}.enable", relax.TensorType([], "float32"))
        return self.switch_vars[layer]

    def _input_switch(self, expr):
        """The switch of this layer's quantize of ``expr``: its own, or, when ``expr`` is
        another layer's int32 result, on while either layer is on (that layer exits as
        int8 even into a layer kept in fp32: see autoq.rules.exits)."""
        producer = self.carriers.get(expr)
        if producer is None or producer.layer == self.layer:
            return None
        both = relax.op.maximum(self._switch(producer.layer), self._switch())
        return self.writer.emit(both, f"{self.layer}.enable_{producer.layer}")

    def _uses(self, sid: str) -> None:
        if self.match is not None:
            used = self.layer_slots.setdefault(self.layer, [])
            if sid not in used:
                used.append(sid)

    def value(self, expr) -> relax.Expr:
        """The simulated-graph value of an operand of the original graph."""
        return remap_expr(expr, self.vmap)

    def copy(self, expr) -> relax.Expr:
        """A binding outside every match (or the function's result), its operands mapped;
        an operand with an exit slot is read quantized-dequantized (see autoq.rules.exits)."""
        local = {u: self.exit_real(u) for u in free_vars(expr) if u in self.exits}
        return remap_expr(expr, {**self.vmap, **local})

    copy_result = copy

    def exit_real(self, var) -> relax.Expr:
        """The exit slot's dequantized value of ``var`` (its slot belongs to the layer that
        produced it: that layer's spec, switch and slot list)."""
        prev, self.match = self.match, self.exits[var]
        try:
            return self.activation(var).real
        finally:
            self.match = prev

    @property
    def layer(self) -> str:
        return self.match.layer if self.match is not None else ""

    def spec(self, kind: str, layer: str, slot: str | None = None) -> QuantSpec:
        m = self.match
        return self.config.layer_spec(kind, layer, m.pattern.name if m else None, slot)

    def act_spec(self, sid: str, layer: str) -> QuantSpec:
        """The spec of activation slot ``sid`` created by ``layer`` (:meth:`Config.layer_spec`:
        int16 when ``Config.int16_tensors`` names the slot)."""
        return self.spec("activation", layer, sid)

    def _new_slot(self, sid, kind, spec, shape, axis, length, tensor_shape, op):
        if sid in self.plan.slots:
            raise ValueError(f"slot id {sid!r} is used twice; layer ids must be unique")
        self.plan.slots[sid] = SlotInfo(sid, kind, self.layer, op, tuple(tensor_shape or ()), axis)
        self.plan.specs[sid] = spec
        sshape = [] if length is None else [length]
        s = relax.Var(f"{sid}.scale", relax.TensorType(sshape, "float32"))
        z = relax.Var(f"{sid}.zero_point", relax.TensorType(sshape, "int32"))
        self.qparam_vars[sid] = (s, z)
        return s, z

    def _value_input(self, key: str, expr, shape) -> relax.Expr:
        """``expr``'s value, or with ``Config.tunes_weights`` a runtime input ``<key>.value``
        (calibration may replace a weight by the dequantized integers it chose, a bias by the
        corrected one: :mod:`autoq.accuracy.weight_tuning`; :meth:`SimResult.input_values`).
        Switch mode: a layer switched off reads the model's own tensor, as a layer kept in
        fp32 is realized with it."""
        if not self.config.tunes_weights:
            return self.value(expr)
        var = relax.Var(f"{key}.value", relax.TensorType(list(shape), "float32"))
        self.value_vars[key] = var
        if not self.switches:
            return var
        on = relax.op.greater(self._switch(), const(0.0, "float32"))
        return self.emit(relax.op.where(on, var, relax.op.reshape(self.value(expr), list(shape))))

    # ---- slots
    def activation(self, expr) -> _LazyQ:
        """The quantized version of an activation tensor (one slot per tensor, shared)."""
        if not isinstance(expr, relax.Var) or not self.g.is_data_dependent(expr):
            raise ValueError(f"{self.layer}: operand {expr} is not an activation")
        sid = self.tensor_id(expr)
        self._uses(sid)
        if self.switches and sid in self.plan.slots:
            # switch mode: every consumer quantizes the tensor itself, under its own switch
            key = f"{sid}@{self.layer}"
            if key not in self._acts:
                s, z = self.qparam_vars[sid]
                dtype, ax = self.plan.specs[sid].dtype, self.plan.slots[sid].axis
                q = self.emit(
                    qnn.simulated_quantize(self.value(expr), s, z, axis=ax or -1, dtype=dtype),
                    f"{sid}.q_{self.layer}",
                    switch=self._input_switch(expr),
                )
                self._acts[key] = _LazyQ(self, q, s, z, ax)
            return self._acts[key]
        if sid in self._acts:
            return self._acts[sid]
        spec = self.act_spec(sid, self.layer)
        if expr in self.clipped:
            spec = clip_ranges.spec_for(spec)
        channels, ax = self.channel_slot(expr)
        s, z = self._new_slot(
            sid, "activation", spec, None, ax, channels, shape_of(expr), self.match.pattern.name
        )
        q = self.emit(
            qnn.simulated_quantize(self.value(expr), s, z, axis=ax or -1, dtype=spec.dtype),
            f"{sid}.q",
            switch=self._input_switch(expr) if self.switches else None,
        )
        self.plan.tensors[sid] = expr
        self.sq_vars[sid] = q
        handle = _LazyQ(self, q, s, z, ax)
        self._acts[sid] = handle
        if self.switches:
            self._acts[f"{sid}@{self.layer}"] = handle
        return handle

    def dynamic_activation(self, expr) -> hybrid.SimulatedDynamicQ:
        """``expr`` quantized at run time with the current layer's (dynamic) activation spec,
        as the realized ``qnn.dynamic_quantize`` does (:mod:`autoq.rules.hybrid`); no slot. Shared
        by the layers reading it with the same spec (switch mode: one per layer)."""
        spec = self.spec("activation", self.layer)
        sid = self.tensor_id(expr)
        key = hybrid.dynamic_key(sid, spec) + ((self.layer,) if self.switches else ())
        if key not in self._dynamic:
            value = self.value(expr)
            dq = hybrid.emit_dynamic_quantize(self.writer.emit, value, spec, sid)
            enable = self._switch() if self.switches else None
            self._dynamic[key] = hybrid.simulated_input(self.writer.emit, dq, value, enable)
        return self._dynamic[key]

    def weight(self, expr, axis: int | None) -> _LazyQ:
        """The quantized version of the layer's weight; ``axis`` is its output-channel axis
        (None: always per tensor, e.g. the constant operand of an elementwise op)."""
        ref: WeightRef | None = self.g.weight_of(expr)
        if ref is None:
            raise ValueError(f"{self.layer}: operand {expr} is not a weight")
        sid = f"{self.layer}.weight"
        self._uses(sid)
        spec = self.spec("weight", self.layer)
        arr = np.asarray(ref.array, dtype=np.float32)
        ax = axis % arr.ndim if spec.per_channel and axis is not None else None
        length = arr.shape[ax] if ax is not None else None
        s, z = self._new_slot(
            sid, "weight", spec, arr.shape, ax, length, arr.shape, self.match.pattern.name
        )
        self.plan.weights[sid] = (arr, ax)
        src = self._value_input(sid, expr, arr.shape)
        q = self.emit(
            qnn.simulated_quantize(src, s, z, axis=-1 if ax is None else ax, dtype=spec.dtype),
            f"{sid}.q",
        )
        return _LazyQ(self, q, s, z, ax)

    def bias(
        self, expr, acc_scale: relax.Expr, out_shape: list[int], channel_axis: int
    ) -> relax.Expr:
        """The int32-quantized bias (scale ``acc_scale``, zp 0) shaped to add to the accumulator."""
        ref = self.g.weight_of(expr)
        n = int(np.prod(ref.array.shape))
        key = f"{self.layer}.bias"
        if self.config.tunes_weights:
            flat = self._value_input(key, expr, [n])
            x_sid = self.tensor_id(self.match["data"])
            arr = np.asarray(ref.array, np.float32).reshape(-1)
            self.plan.biases[self.layer] = (arr, x_sid, f"{self.layer}.weight")
        else:
            flat = self.emit(relax.op.reshape(self.value(expr), [n]))
        zeros = const(np.zeros([n] if acc_scale.ty.ndim == 1 else [], np.int32))
        q = self.emit(qnn.simulated_quantize(flat, acc_scale, zeros, axis=0, dtype="int32"))
        shape = [1] * len(out_shape)
        shape[channel_axis] = n
        return self.emit(relax.op.reshape(q, shape))

    def lut_output(self, x: _LazyQ, real: relax.Expr, activation) -> relax.Expr:
        """The current match's result as a table lookup of its input ``x`` (an 8-bit slot
        of this layer): ``real`` (the float activation of ``x.real``) is what the output
        slot's calibrator observes; the output integers are ``table[x - qmin]``, the table
        a runtime input ``<layer>.table`` computed from both slots' qparams
        (:func:`autoq.ir.activations.lut_table`), so the realized ``qnn.lut`` is predicted bit
        for bit. ``activation``: a row's name or an :class:`autoq.ir.activations.Activation`
        (e.g. :func:`autoq.ir.activations.affine`). Falls back to :meth:`output` (float
        activation, then quantize) when either slot is not 8-bit."""
        m = self.match
        in_sid = self.tensor_id(m["data"])
        spec = self.act_spec(m.layer, m.layer)
        in_dtype = self.plan.specs[in_sid].dtype
        if spec.dtype not in LUT_DTYPES or in_dtype not in LUT_DTYPES:
            return self.output(real)
        sid = m.layer
        self._uses(sid)
        out_rows, out_ax = self.channel_slot(m.root)
        s, z = self._new_slot(
            sid, "activation", spec, None, out_ax, out_rows, shape_of(m.root), m.pattern.name
        )
        pre = self.emit(real, f"{sid}.pre")
        q_ax = -1 if out_ax is None else out_ax
        sq = qnn.simulated_quantize(pre, s, z, axis=q_ax, dtype=spec.dtype)
        observed = self.emit(sq, f"{sid}.sq")
        rows, axis = self.channel_slot(m["data"]) if x.axis is not None else (out_rows, out_ax)
        tshape = [256] if rows is None else [rows, 256]
        table = relax.Var(f"{m.layer}.table", relax.TensorType(tshape, "float32"))
        self.table_vars[m.layer] = table
        self.plan.tables[m.layer] = (in_sid, sid, activation)
        idx = relax.op.subtract(x.q, const(qrange(in_dtype)[0], "float32"))
        if rows is not None:  # one table per channel (along its axis): row c starts at c * 256
            shape = [1] * len(shape_of(m.root))
            shape[axis] = rows
            offsets = np.arange(rows, dtype=np.float32).reshape(shape) * 256
            idx = relax.op.add(self.emit(idx), const(offsets))
            table = self.emit(relax.op.reshape(table, [rows * 256]))
        idx = self.emit(relax.op.astype(idx, "int32"))
        q = relax.op.take(table, idx, axis=0, mode="clip")
        if self.switches:  # switched off: the float activation, unrounded
            on = relax.op.greater(self._switch(), const(0.0, "float32"))
            q = relax.op.where(on, self.emit(q), observed)
        q = self.emit(q, f"{sid}.q")
        self.plan.tensors[sid] = m.root
        self.sq_vars[sid] = observed
        handle = _LazyQ(self, q, s, z, out_ax)
        self._acts[sid] = handle
        return handle.real

    def output(self, real: relax.Expr) -> relax.Expr:
        """Quantize the current match's result with its own slot (ops with an int8 output);
        later consumers of the root tensor reuse this slot."""
        m = self.match
        sid = m.layer
        self._uses(sid)
        spec = self.act_spec(sid, sid)
        channels, ax = self.channels.get(m.root, (None, None))
        s, z = self._new_slot(
            sid, "activation", spec, None, ax, channels, shape_of(m.root), m.pattern.name
        )
        pre = self.emit(real, f"{sid}.pre")
        sq = qnn.simulated_quantize(pre, s, z, axis=-1 if ax is None else ax, dtype=spec.dtype)
        q = self.emit(sq, f"{sid}.q")
        self.plan.tensors[sid] = m.root
        self.sq_vars[sid] = q
        handle = _LazyQ(self, q, s, z, ax)
        self._acts[sid] = handle
        return handle.real
