"""Every layer exits as int8: where an int32 result leaves the integer part of the graph.

An accumulating layer (conv2d, dense, matmul, the sums of a mean) produces an int32
accumulator. When all its consumers are integer layers, each consumer's input quantize
meets the layer's dequantize and they merge into one ``qnn.requantize``: the tensor leaves
the layer as int8. But a consumer that runs in float (a layer left in fp32, softmax, layer
norm, the model's output) would read ``qnn.dequantize(int32)``, an int32 tensor crossing a
layer boundary, which no accelerator offloads. :func:`exit_tensors` finds those tensors
(following the allow-list's ``commute`` ops from the layer, e.g. a ReLU after a conv), and
simulate and realize give each one an activation slot of its own, its **exit slot**,
calibrated like any other: the float consumers read ``dequantize(quantize(tensor))``, which
realize turns into ``requantize(int32 -> int8) -> dequantize``.

The model's outputs read their layer's int32 accumulator through one ``qnn.dequantize``
unless ``Config.int8_outputs`` asks for exit slots there too (precision: see that option).
Layers whose result is already int8 (elementwise ops with their own output qparams,
``Pattern.int8_output``) need none.
"""

from __future__ import annotations

from tvm import relax

from autoq.ir.allow_list import ALLOW_LIST
from autoq.ir.graph import Graph
from autoq.ir.registry import Match
from autoq.ir.toolkit import op_name

__all__ = ["exit_tensors", "int32_carriers"]


def _carried_operands(value) -> list:
    """The operands whose integer values a commute op carries to its output."""
    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value]
    rule = ALLOW_LIST.get(op_name(value))
    if rule is None or rule.kind != "commute" or not value.args:
        return []
    first = value.args[0]
    if rule.operands == "fields" and isinstance(first, relax.Tuple):
        return list(first.fields)
    return [first]


def int32_carriers(
    g: Graph, matches: list[Match], float_results: frozenset[str] = frozenset()
) -> dict[relax.Var, Match]:
    """Tensors holding (a commute op of) an int32 layer result -> that layer.
    ``float_results``: layers whose result is float32 (dynamic layers, :mod:`autoq.rules.hybrid`)."""
    covered = {v for m in matches for v in m.covered}
    carrier = {
        m.root: m for m in matches if not m.pattern.int8_output and m.layer not in float_results
    }
    for var, value in g.bindings:
        if var in covered or var in carrier:
            continue
        for operand in _carried_operands(value):
            if operand in carrier:
                carrier[var] = carrier[operand]
                break
    return carrier


def _returns(g: Graph, var) -> bool:
    """``var`` only packs the function's outputs (``gv = (a, b)`` returned as it is)."""
    return var in set(g.output_vars()) and isinstance(g.value.get(var), relax.Tuple)


def exit_tensors(
    g: Graph,
    matches: list[Match],
    outputs: bool = False,
    float_results: frozenset[str] = frozenset(),
) -> dict[relax.Var, Match]:
    """Tensor -> the layer whose int32 result it carries, for every such tensor that a float
    consumer (a binding outside every match that is not a commute op carrying it on; with
    ``outputs``, also the function's output) reads; in topological order. A layer of
    ``float_results`` (dynamic) neither carries one nor counts as a float consumer."""
    carrier = int32_carriers(g, matches, float_results)
    covered = {v for m in matches for v in m.covered}
    out_vars = set(g.output_vars()) if outputs else set()
    exits: dict[relax.Var, Match] = {}
    for var, _ in g.bindings:
        if var not in carrier:
            continue
        for user in g.users.get(var, []):
            if user in covered or user in carrier or _returns(g, user):
                continue
            exits[var] = carrier[var]
            break
        if var in out_vars:
            exits[var] = carrier[var]
    return exits
