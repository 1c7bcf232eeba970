"""ONNX control flow fixed by the inputs: ``constant_inputs`` written into the model, ``If``
nodes whose condition is then a constant replaced by the branch they take, and a clear error
for the control flow that is left (a data-dependent ``If``, ``Loop`` or ``Scan``).

Real exports branch on values the user fixes: silero-vad's ONNX file takes a sample-rate
input ``sr`` and branches on ``sr == 16000`` at the top; torch's exporter writes ``If`` on
shapes (``Equal(Size(x), 0)``) that become constants once the input shapes are static. Such
an ``If`` is inlined: the taken branch's nodes join the graph (a name that clashes with an
outer one gets the ``If`` node's name as prefix, in the nested graphs too), its outputs are
renamed to the ``If`` outputs through ``Identity``, and its initializers join the graph's.
A condition is constant when it is an initializer, a ``Constant`` node or computable from
them (evaluated with onnx's reference evaluator); ONNX Runtime's constant folding (run
between rounds by :func:`autoq.from_onnx`) turns the shape ones into constants.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autoq.frontends.errors import FrontendError

__all__ = ["CONTROL_FLOW_OPS", "apply_constant_inputs", "check_no_control_flow", "fold_ifs"]

CONTROL_FLOW_OPS = ("If", "Loop", "Scan")


def apply_constant_inputs(model, values: Mapping[str, object] | None) -> None:
    """Make each named data input of ``model`` an initializer holding its value (in place),
    cast to the input's declared type; its declared static dims must match."""
    import onnx
    from onnx import numpy_helper

    if not values:
        return
    if not isinstance(values, Mapping):
        raise TypeError("constant_inputs must be a dict {input name: value}")
    inits = {t.name for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in inits}
    for name, value in values.items():
        if name not in inputs:
            raise ValueError(
                f"constant_inputs names {name!r}, which is not a data input of the model; "
                f"its inputs are: {', '.join(repr(n) for n in inputs)}"
            )
        tt = inputs[name].type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        try:
            array = np.asarray(value).astype(dtype)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"constant_inputs[{name!r}] = {value!r} is not a {dtype} value: {e}"
            ) from None
        if tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            ok = len(dims) == array.ndim and all(
                d in (None, 0) or d == s for d, s in zip(dims, array.shape, strict=True)
            )
            if not ok:
                raise ValueError(
                    f"constant_inputs[{name!r}] has shape {array.shape}; the model declares "
                    f"input {name!r} with dims {[d or '?' for d in dims]}"
                )
        model.graph.initializer.append(numpy_helper.from_array(array, name))
    keep = [i for i in model.graph.input if i.name not in values]
    del model.graph.input[:]
    model.graph.input.extend(keep)


def _local_names(graph) -> set[str]:
    return {o for n in graph.node for o in n.output if o} | {t.name for t in graph.initializer}


def _rename(graph, names: dict[str, str]) -> None:
    """Rename values in ``graph`` and the graphs nested in it (in place)."""
    for node in graph.node:
        node.input[:] = [names.get(x, x) for x in node.input]
        node.output[:] = [names.get(x, x) for x in node.output]
        for attr in node.attribute:
            if attr.HasField("g"):
                _rename(attr.g, names)
            for g in attr.graphs:
                _rename(g, names)
    for t in graph.initializer:
        t.name = names.get(t.name, t.name)
    for vi in (*graph.value_info, *graph.output):
        vi.name = names.get(vi.name, vi.name)


def _inline(model, index: int, take_then: bool, taken: set[str]) -> None:
    from onnx import GraphProto, helper

    node = model.graph.node[index]
    attrs = {a.name: a.g for a in node.attribute}
    branch = GraphProto()
    branch.CopyFrom(attrs["then_branch" if take_then else "else_branch"])
    prefix = node.name or f"If_{index}"
    renames = {}
    for name in sorted(_local_names(branch)):
        if name in taken:
            new, k = f"{prefix}/{name}", 0
            while new in taken:
                k += 1
                new = f"{prefix}/{name}_{k}"
            renames[name] = new
        taken.add(renames.get(name, name))
    _rename(branch, renames)
    outs = [
        helper.make_node("Identity", [b.name], [o], name=f"{prefix}/output_{k}")
        for k, (b, o) in enumerate(zip(branch.output, node.output, strict=True))
    ]
    model.graph.initializer.extend(branch.initializer)
    model.graph.value_info.extend(branch.value_info)
    nodes = list(model.graph.node)
    nodes[index : index + 1] = [*branch.node, *outs]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _constant_value(model, name: str):
    """The value of ``name`` when it is computable from initializers and ``Constant`` nodes
    alone, else None."""
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    inits = {t.name: t for t in model.graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name])
    producer = {o: n for n in model.graph.node for o in n.output}
    needed, stack, leaves = [], [name], set()
    seen: set[str] = set()
    while stack:
        x = stack.pop()
        if x in seen or not x:
            continue
        seen.add(x)
        if x in inits:
            leaves.add(x)
            continue
        node = producer.get(x)
        if node is None or node.op_type in CONTROL_FLOW_OPS or node.domain not in ("", "ai.onnx"):
            return None  # a data input, or control flow upstream
        needed.append(node)
        stack.extend(node.input)
    order = [n for n in model.graph.node if any(n is m for m in needed)]
    graph = helper.make_graph(
        order,
        "condition",
        [],
        [helper.make_value_info(name, helper.TypeProto())],
        [inits[x] for x in sorted(leaves)],
    )
    sub = helper.make_model(graph, opset_imports=model.opset_import)
    try:
        return ReferenceEvaluator(sub).run(None, {})[0]
    except Exception:  # an op the reference evaluator lacks: not foldable here
        return None


def fold_ifs(model) -> int:
    """Inline every top-level ``If`` of ``model`` whose condition is constant (in place,
    repeatedly: an inlined branch may hold more); the number inlined."""
    taken = {o for n in model.graph.node for o in n.output}
    taken |= {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    count = 0
    while True:
        for k, node in enumerate(model.graph.node):
            if node.op_type != "If":
                continue
            cond = _constant_value(model, node.input[0])
            if cond is not None and np.asarray(cond).size == 1:
                _inline(model, k, bool(np.asarray(cond).reshape(())), taken)
                count += 1
                break
        else:
            return count


def check_no_control_flow(model) -> None:
    """A :class:`FrontendError` naming the first control-flow node left in ``model``."""
    for k, node in enumerate(model.graph.node):
        if node.op_type not in CONTROL_FLOW_OPS:
            continue
        name = node.name or f"{node.op_type}#{k}"
        if node.op_type != "If":
            raise FrontendError(
                f"{node.op_type} node {name!r}: autoq quantizes only graphs without control "
                f"flow and does not unroll {node.op_type}; export the model with the loop "
                "unrolled (a fixed-length trace), or keep this part outside the model"
            )
        raise FrontendError(
            f"If node {name!r}: its condition {node.input[0]!r} depends on the model's data, "
            "and autoq quantizes only graphs without control flow. If it depends on an input "
            "you can fix (a sample rate, a mode flag), pass constant_inputs={name: value} "
            "(CLI: --constant-input name=value); if it depends on a dynamic dimension, fix it "
            "with input_shapes."
        )
