"""Stage 4, the layers and their slots: which matches take their quantization from the file
(the others fall back to fp32, with the reason), the qparams and integer weights/biases of
every slot, and the tensors the file rounds where they are read in float.

A match is quantized with the file's qparams when the file quantizes its activation inputs
(and, for elementwise ops, its output) and stores its weight as integers. Whether it does
depends on the match, the graph and the file only, never on which other layers fall back (a
fallback only filters matches, :mod:`autoq.ir.matching`), so one pass over the matches decides
every fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from autoq.config import Config, Fallback
from autoq.importers.tensors import FileView, LayerWeight, weight_layout
from autoq.ir.allow_list import ALLOW_LIST
from autoq.ir.graph import Graph
from autoq.ir.registry import Match, slot_id_of
from autoq.ir.toolkit import op_name
from autoq.qparams import QParam
from autoq.simulation import SimResult

__all__ = ["Plan", "fallback_reasons", "fill", "float_ops", "merge_fallback", "rounding_points"]

_ACCUMULATING = ("conv2d", "dense", "matmul")


def _match_inputs(g: Graph, m: Match) -> list[relax.Var]:
    """Activation operands of a match (data-dependent vars it reads but does not compute)."""
    covered = set(m.covered)
    out = []
    for v in m.nodes.values():
        if isinstance(v, relax.Var) and v not in covered and g.is_data_dependent(v):
            if not any(v.same_as(u) for u in out):
                out.append(v)
    return out


def _owns_output_slot(sim: SimResult, m: Match) -> bool:
    """Whether the pattern quantizes its own output (elementwise ops with an int8 result)."""
    info = sim.slots.get(m.layer)
    t = sim.plan.tensors.get(m.layer)
    return info is not None and info.layer == m.layer and t is not None and t.same_as(m.root)


def _check_inputs(view: FileView, m: Match) -> str | None:
    kind = m.pattern.name.split("_")[0]
    for v in _match_inputs(view.g, m):
        name = view.tens.resolve(v)
        if name is None:
            return f"its input {view.tens.describe(v)} is not quantized in the file"
        dtype = view.split.activations[name].dtype
        if kind in _ACCUMULATING and dtype not in ("int8", "uint8"):
            return f"its input {name!r} is {dtype} (qnn.{kind} takes int8/uint8)"
    return None


def _check_weight(view: FileView, m: Match) -> str | None:
    """Why the file's integers cannot be the layer's weight; records the layout if they can."""
    wkey = m.pattern.weight
    if not wkey or wkey not in m.nodes:
        return None
    ref = view.g.weight_of(m.nodes[wkey])
    if ref is None:
        return "its weight is not a constant"
    c = view.const(ref.name) if ref.name is not None else view.inline_const(ref.array)
    if c is None and ref.name is None:
        return "its constant operand is stored in float in the file"
    if c is None:
        return f"its weight {ref.name!r} is stored in float in the file"
    name = ref.name or c.name
    if c.q.dtype not in ("int8", "uint8"):
        return f"its weight {name!r} is {c.q.dtype} (qnn weights are int8/uint8)"
    perm = weight_layout(ref.array, c)
    if perm is None:
        return (
            f"its weight {name!r} no longer holds the file's values after import "
            "(changed by a fusion? try optimize=False)"
        )
    if c.q.axis is not None:
        want = 0 if m.pattern.name.startswith("conv2d") else ref.array.ndim - 1
        if perm.index(c.q.axis) != want:
            return f"its weight {name!r} is quantized per axis {c.q.axis}, not per output channel"
    view.weights[m.layer] = LayerWeight(ref, c, perm)
    return None


def fallback_reasons(view: FileView, sim: SimResult) -> dict[str, str]:
    """Layer -> why it cannot take its quantization from the file, for every match of
    ``sim`` (one pass: a reason never depends on the other layers' fallback)."""
    out = {}
    for m in sim.matches:
        reason = _check_inputs(view, m)
        if reason is None and _owns_output_slot(sim, m):
            name = view.tens.quantized_name(m.root)
            if name is None:
                reason = "its output is not quantized in the file"
        reason = reason or _check_weight(view, m)
        if reason is not None:
            out[m.layer] = reason
    return out


def merge_fallback(config: Config, ids: dict[str, str]) -> Config:
    """``config`` with the layers ``ids`` added to its fallback ids."""
    if not ids:
        return config
    fb = config.fallback or Fallback()
    new = Fallback(
        ids=tuple(fb.ids) + tuple(i for i in ids if i not in fb.ids),
        op_types=tuple(fb.op_types),
        patterns=tuple(fb.patterns),
        validate=bool(fb.validate),
    )
    return config.replace(fallback=new)


# ---------------------------------------------------------------------------- the qparams


@dataclass
class Plan:
    """The file's qparams per slot, the integer weights/biases, and notes for the report."""

    qparams: dict[str, QParam]
    values: dict[str, np.ndarray]
    notes: list[str]


def _bias_values(view: FileView, m: Match, acc: np.ndarray, plan: Plan) -> None:
    """``plan.values[<layer>.bias]``: the file's int32 bias on the accumulator's grid
    (scale ``acc``, zero point 0), rescaled when the file's bias has another scale."""
    b = view.g.weight_of(m.nodes["bias"])
    bc = view.const(b.name) if b is not None else None
    if bc is None:
        plan.notes.append(
            f"{m.layer}: the file keeps the bias {b.name if b else '?'!r} in float; "
            "autoq quantized it (int32, scale input_scale * weight_scale)"
        )
        return
    ints = bc.values.reshape(-1).astype(np.int64)
    bscale = np.broadcast_to(bc.q.scale, ints.shape).astype(np.float32)
    bzp = np.broadcast_to(bc.q.zero_point, ints.shape).astype(np.int64)
    acc = np.broadcast_to(acc, ints.shape)
    if np.any(bzp != 0) or not np.array_equal(bscale, acc):
        # the file's bias has another scale: move it onto the accumulator's grid
        real = (ints - bzp).astype(np.float64) * bscale.astype(np.float64)
        ints = np.rint(real / acc.astype(np.float64))
        plan.notes.append(
            f"{m.layer}: the file's bias {bc.source!r} has scale/zero point different from "
            "input_scale * weight_scale / 0; rescaled to the accumulator's scale"
        )
    plan.values[f"{m.layer}.bias"] = np.clip(ints, -(2**31), 2**31 - 1).astype(np.int32)


def fill(view: FileView, sim: SimResult) -> Plan:
    """QParams for every slot of ``sim`` from the file, and the integer weights/biases."""
    plan = Plan({}, {}, [])
    layer_of = {m.layer: m for m in sim.matches}
    slot_of = slot_id_of(view.g, sim.matches)
    for sid, info in sim.slots.items():
        if info.kind == "activation":
            name = view.tens.quantized_name(sim.plan.tensors[sid])
            plan.qparams[sid] = view.split.activations[name].qparam()
            continue
        m = layer_of[sid.removesuffix(".weight")]
        w = view.weights[m.layer]
        axis = None if w.const.q.axis is None else w.perm.index(w.const.q.axis)
        plan.qparams[sid] = w.const.q.qparam(axis)
        plan.values[sid] = np.ascontiguousarray(np.transpose(w.const.values, w.perm))
        if "bias" in m.nodes:
            x = plan.qparams[slot_of(m.nodes["data"])]
            _bias_values(view, m, (x.scale * plan.qparams[sid].scale).astype(np.float32), plan)
    return plan


def rounding_points(view: FileView, matches: list[Match]) -> dict[relax.Var, QParam]:
    """Quantized tensors read by a binding outside every integer layer (a fallback layer,
    softmax, ...): there the file's rounding is a ``quantize -> dequantize`` pair
    (:func:`autoq.realization`'s ``rounding_points``). The ``qnn`` bindings of the outputs
    (:func:`.tensors.float_module`) round by themselves."""
    g = view.g
    covered = {v for m in matches for v in m.covered}
    out = {}
    for name, var in view.tens.var.items():
        users = g.users.get(var, [])
        if any(u not in covered and not op_name(g.value[u]).startswith("qnn.") for u in users):
            out[var] = view.split.activations[name].qparam()
    return out


def float_ops(view: FileView, sim: SimResult) -> dict[str, str]:
    """ONNX nodes next to quantized tensors that run in fp32 (label -> Relax op)."""
    g, tens, split = view.g, view.tens, view.split
    covered = {v for m in sim.matches for v in m.covered}
    out = {}

    def integer(v) -> bool:
        """Runs on integers after realize: in a match, or an allow-list op that propagate
        moves into the integer domain (its output is quantized, or dequantize moves below)."""
        if v in covered or v not in g.value:
            return True
        value = g.value[v]
        if not isinstance(value, tvm.ir.Call) or op_name(value).startswith("qnn."):
            return True
        rule = ALLOW_LIST.get(op_name(value))
        if rule is None or rule.kind != "commute":
            return False
        return rule.dequantize_below or tens.name.get(v) in split.activations

    for name, var in tens.var.items():
        if not integer(var):
            out[split.producer.get(name, name)] = _short(g, var)
        for u in g.users.get(var, []):
            if integer(u):
                continue
            uname = tens.name.get(u)
            label = split.producer.get(uname) if uname else None
            if label is None:
                cons = split.consumers.get(name, [])
                label = cons[0] if len(cons) == 1 else f"a consumer of {name!r}"
            out[label] = _short(g, u)
    return out


def _short(g: Graph, v) -> str:
    return op_name(g.value[v]).removeprefix("relax.")
