"""The plan of topological calibration: the simulated graph cut into segments.

:func:`build_plan` cuts the simulated ``main`` into a **prologue** (everything that depends
on weights and weight qparams only, computed once) and **segments**, one starting at each
activation slot's ``qnn.simulated_quantize``, and works out which values each segment reads
and writes and after which segment a value is no longer needed. It returns the plan as
plain data (:class:`CalibrationPlan`: graph values are integer *keys*, slots are strings)
plus the Relax functions to compile, so that the plan can be shipped to another process (a
Dask worker, see :mod:`autoq.calibration.shard_runner`) with the compiled library.

Keys: the simulated function's parameters are ``0 .. P-1`` in order, its bindings ``P + i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import relax

from autoq.ir.toolkit import bindings, free_vars, make_function, slice_bindings
from autoq.simulation import SimResult

__all__ = ["CalibrationPlan", "Segment", "build_plan"]


@dataclass
class Segment:
    """``name`` (its compiled function), ``heads`` (the activation slots whose quantize
    starts it: their qparams are chosen just before it runs), ``inputs``/``outputs`` (keys,
    in the function's order) and ``drop`` (keys last read here: freed after it runs)."""

    name: str
    heads: list[str] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)


@dataclass
class CalibrationPlan:
    """Plain data describing a topological calibration (see the module docstring)."""

    #: (model input name, key) in the model's input order
    inputs: list[tuple[str, int]]
    #: the prologue, in parts: one function per set of weight / weight-qparam inputs (keys)
    #: read, with the keys it writes; weight tuning recomputes only the parts reading a
    #: changed input
    prologue: list[Segment]
    segments: list[Segment]
    #: activation slot -> key of the float tensor its quantize reads
    head_tensor: dict[str, int]
    #: slot -> (scale key, zero point key) of its qparam inputs
    qparam_keys: dict[str, tuple[int, int]]
    #: key -> weight parameter name
    weight_keys: dict[int, str]
    #: layer -> key of its lookup-table input (computed once its output slot is chosen)
    table_keys: dict[str, int] = field(default_factory=dict)
    #: ``<layer>.weight`` / ``<layer>.bias`` -> key of its value input (weights that
    #: calibration may change: :mod:`autoq.accuracy.weight_tuning`)
    value_keys: dict[str, int] = field(default_factory=dict)

    #: per-channel activation slots -> their channel axis (:mod:`autoq.rules.lut_channels`)
    axes: dict[str, int] = field(default_factory=dict)


def _keys(func: relax.Function) -> tuple[dict, list]:
    pairs = bindings(func)
    key = {p: i for i, p in enumerate(func.params)}
    key.update({v: len(func.params) + i for i, (v, _) in enumerate(pairs)})
    return key, pairs


def _cut(pairs, needed: set, dynamic: set, sq_slot: dict) -> list[tuple[Segment, list]]:
    """Segments (with their bindings) of the needed dynamic bindings, a new one at every
    run of activation quantizes."""
    segs: list[tuple[Segment, list]] = []
    for var, value in pairs:
        if var not in needed or var not in dynamic:
            continue
        if var in sq_slot:
            if not segs or (segs[-1][1] and segs[-1][1][-1][0] not in sq_slot):
                segs.append((Segment(f"seg_{len(segs)}"), []))
            segs[-1][0].heads.append(sq_slot[var])
        elif not segs:
            segs.append((Segment("seg_0"), []))
        segs[-1][1].append((var, value))
    return segs


def _liveness(segs: list[tuple[Segment, list]]) -> tuple[list[list], list[list], dict]:
    """Per segment: the vars it reads from outside (first-use order) and the vars it
    defines that a later segment reads; and each var's last reading segment."""
    defined_in = {v: i for i, (_, b) in enumerate(segs) for v, _ in b}
    last_use: dict = {}
    ins: list[list] = []
    for i, (_, b) in enumerate(segs):
        seen: list = []
        known: set = set()  # the vars of seen (a relax Var hashes and compares by its handle)
        for _, value in b:
            for u in free_vars(value):
                if defined_in.get(u) != i and u not in known:
                    seen.append(u)
                    known.add(u)
                last_use[u] = i
        ins.append(seen)
    outs = [[v for v, _ in b if last_use.get(v, -1) > i] for i, (_, b) in enumerate(segs)]
    return ins, outs, last_use


def _prologue_parts(prologue: list, outputs: list, params: set, key: dict) -> list:
    """The prologue ``outputs`` grouped by the parameters they are computed from:
    ``[(inputs in key order, outputs)]``, in the order of each group's first output (the
    parts of a ResNet-50: one per layer, its weight and weight qparams)."""
    value_of = dict(prologue)
    reads: dict = {}  # prologue var -> the parameters it depends on

    def roots(v) -> frozenset:
        if v in params:
            return frozenset([v])
        if v not in reads:
            reads[v] = frozenset().union(*(roots(u) for u in free_vars(value_of[v])))
        return reads[v]

    for v, _ in prologue:  # in binding order: every operand's set is known before it
        roots(v)
    groups: dict[frozenset, list] = {}
    for v in outputs:
        groups.setdefault(roots(v), []).append(v)
    return [(sorted(ins, key=key.get), outs) for ins, outs in groups.items()]


def _unread_quantizes(segs: list[tuple[Segment, list]], sq_slot: dict) -> set:
    """The activation quantizes whose result no binding reads: a lookup's output slot (the
    next layer reads the table's integers) or a model output. The compiled segments leave
    them out; the plan keeps them, so that their input is still cached for the slot's
    observer up to the segment they head."""
    read = {u for _, b in segs for _, value in b for u in free_vars(value)}
    return {v for v in sq_slot if v not in read}


def build_plan(sim: SimResult) -> tuple[CalibrationPlan, dict[str, relax.Function]]:
    """The plan of ``sim``'s topological calibration and the functions to compile
    (``prologue`` and one per segment)."""
    func = sim.mod["main"]
    key, pairs = _keys(func)
    names = {p.name: p for p in func.params}
    act_slots = sim.activation_slots()
    inputs = [names[v.name] for v in sim.graph.inputs]
    sq_slot = {sim.sq_vars[sid]: sid for sid in act_slots}
    roots = set(inputs) | {names[v.name] for s in act_slots for v in sim.qparam_vars[s]}
    roots |= {names[v.name] for v in sim.table_vars.values()}
    dynamic: set = set()
    for var, value in pairs:
        if any(u in dynamic or u in roots for u in free_vars(value)):
            dynamic.add(var)
    needed = {v for v, _ in slice_bindings(pairs, sq_slot)}  # only what feeds a quantize
    prologue = [(v, e) for v, e in pairs if v in needed and v not in dynamic]
    segs = _cut(pairs, needed, dynamic, sq_slot)
    ins, outs, last_use = _liveness(segs)
    pro_vars = {v for v, _ in prologue}
    read = {v for s in ins for v in s}  # read by some segment
    pro_out = sorted((v for v in pro_vars if v in read), key=lambda v: v.name)
    params = set(func.params)
    functions, parts = {}, []
    for i, (part_in, part_out) in enumerate(_prologue_parts(prologue, pro_out, params, key)):
        part = Segment(f"prologue_{i}", inputs=[key[v] for v in part_in])
        part.outputs = [key[v] for v in part_out]
        functions[part.name] = make_function(
            part.name, part_in, slice_bindings(prologue, part_out, part_in), part_out
        )
        parts.append(part)
    static = (params - set(inputs)) | pro_vars  # never cached per sample
    unread = _unread_quantizes(segs, sq_slot)
    for i, (seg, b) in enumerate(segs):
        live = [(v, e) for v, e in b if v not in unread]
        functions[seg.name] = make_function(seg.name, ins[i], live, outs[i])
        seg.inputs = [key[v] for v in ins[i]]
        seg.outputs = [key[v] for v in outs[i]]
        seg.drop = [key[v] for v in ins[i] if last_use.get(v) == i and v not in static]
    value_of = dict(pairs)
    weights = {p.name for p in sim.graph.weight_params}
    plan = CalibrationPlan(
        inputs=[(v.name, key[v]) for v in inputs],
        prologue=parts,
        segments=[s for s, _ in segs],
        head_tensor={sid: key[value_of[var].args[0]] for var, sid in sq_slot.items()},
        qparam_keys={
            sid: (key[names[s.name]], key[names[z.name]]) for sid, (s, z) in sim.qparam_vars.items()
        },
        weight_keys={key[p]: p.name for p in func.params if p.name in weights},
        table_keys={layer: key[names[v.name]] for layer, v in sim.table_vars.items()},
        value_keys={k: key[names[v.name]] for k, v in sim.value_vars.items()},
        axes={
            sid: info.axis
            for sid, info in sim.plan.slots.items()
            if info.kind == "activation" and info.axis is not None
        },
    )
    return plan, functions
