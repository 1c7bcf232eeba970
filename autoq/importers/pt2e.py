"""Stages 1-2 for PyTorch PT2E models: the converted graph -> float graph + the model's qparams.

torchao's PT2E flow (``prepare_pt2e`` -> calibrate -> ``convert_pt2e``) leaves a
``torch.fx.GraphModule`` whose quantization is explicit ``quantized_decomposed`` ops:
``dequantize_per_tensor(quantize_per_tensor(t, s, zp, qmin, qmax, dtype), ...)`` around
activations and ``dequantize_per_channel(int8 constant, scales, zero points, axis, ...)`` for
weights (``fold_quantize=True``, the default; with ``fold_quantize=False`` the weight is a
float constant quantized in the graph, folded here). This module reads them with one rule per
op (:data:`RULES`) and produces the same :class:`.file_qparams.SplitResult` the ONNX reader
does, so the remaining stages (match once, fallback, realize) are shared:

* ``DQ(Q(t))`` becomes ``t``; the model's (scale, zero point, dtype) of ``t`` is recorded
  under the FX node name of ``t``;
* ``DQ(integer constant)`` becomes a float parameter holding the dequantized values, named
  after the layer that reads it (``nn_module_stack``: ``stem.0.weight``), its integers and
  per-channel qparams recorded as a :class:`.file_qparams.FileConst`; a float bias of that
  layer is renamed ``stem.0.bias`` (PT2E keeps biases in float: the int32 bias is computed
  once at import, scale ``input_scale * weight_scale``);
* every quantized activation is appended to the graph's outputs so that the Relax variable it
  becomes is known after :func:`autoq.frontends.from_torch`, as for ONNX (:mod:`.tensors`).

Ops the model leaves in float (hardswish without a quantize after it, ...) stay float.
Dynamic quantization (``choose_qparams``), activations quantized to a restricted range
(``quant_min/quant_max`` other than the dtype's) and per-channel activations are clear errors.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoq.importers.file_qparams import FileConst, FileQ, SplitResult
from autoq.importers.onnx_graph import QuantizedImportError

__all__ = ["RULES", "FloatGraph", "is_torch_model", "split_pt2e"]

_QD = "quantized_decomposed."
_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-32768, 32767), "int32": None}


def _short(target) -> str:
    return str(target).removeprefix(_QD)


def _label(node) -> str:
    return f"{node.name} ({_short(node.target)})"


def is_torch_model(obj) -> bool:
    """Whether ``obj`` is a ``torch.nn.Module`` or ``torch.export.ExportedProgram`` (without
    importing torch when the caller never did)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return isinstance(obj, torch.nn.Module | torch.export.ExportedProgram)


# ------------------------------------------------------------------------- the op rules


@dataclass(frozen=True)
class Rule:
    """How one ``quantized_decomposed`` op is read: ``kind`` is ``quantize`` / ``dequantize``
    / ``dynamic`` (not importable); ``per_channel``: scales and zero points are tensors with
    an ``axis`` argument; ``tensor_args``: per-tensor scale/zero point given as tensors."""

    kind: str
    per_channel: bool = False
    tensor_args: bool = False


#: ``quantized_decomposed`` op overload (without the namespace) -> how it is read
RULES: dict[str, Rule] = {
    "quantize_per_tensor.default": Rule("quantize"),
    "quantize_per_tensor.tensor": Rule("quantize", tensor_args=True),
    "quantize_per_tensor.tensor2": Rule("quantize", tensor_args=True),
    "dequantize_per_tensor.default": Rule("dequantize"),
    "dequantize_per_tensor.tensor": Rule("dequantize", tensor_args=True),
    "dequantize_per_tensor.tensor2": Rule("dequantize", tensor_args=True),
    "quantize_per_channel.default": Rule("quantize", per_channel=True),
    "dequantize_per_channel.default": Rule("dequantize", per_channel=True),
    "choose_qparams.tensor": Rule("dynamic"),
    "choose_qparams_symmetric.tensor": Rule("dynamic"),
    "quantize_per_token.default": Rule("dynamic"),
    "dequantize_per_token.default": Rule("dynamic"),
    "choose_qparams_per_token_asymmetric.default": Rule("dynamic"),
}


def _rule(node) -> Rule | None:
    if node.op != "call_function" or not str(node.target).startswith(_QD):
        return None
    rule = RULES.get(_short(node.target))
    if rule is None:
        raise QuantizedImportError(
            f"{_label(node)}: the quantized_decomposed op {_short(node.target)!r} is not "
            f"supported (supported: {', '.join(RULES)})"
        )
    if rule.kind == "dynamic":
        raise QuantizedImportError(
            f"{_label(node)}: dynamic quantization (qparams computed at run time) is not "
            "supported; quantize the model statically (prepare_pt2e -> calibrate -> convert_pt2e)"
        )
    return rule


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _dtype_name(d) -> str:
    return str(d).removeprefix("torch.")


# ------------------------------------------------------------------------- the reader


@dataclass
class FloatGraph:
    """The float ``torch.fx.GraphModule`` (extra outputs appended) and its split."""

    module: Any
    split: SplitResult
    notes: list[str]


class _Reader:
    """One pass over the converted graph (module doc); each step is a method."""

    def __init__(self, gm):
        import torch

        self.torch, self.gm = torch, gm
        self.graph = torch.fx.Graph()
        self.env: dict = {}
        #: Q node -> (source node, qparams); folded: Q of a constant -> its integers
        self.q_of: dict = {}
        self.folded: dict = {}
        self.alias: dict = {}
        self.activations: dict[str, FileQ] = {}
        self.consts: dict[str, FileConst] = {}
        self.by_source: dict[str, str] = {}
        self.attrs: dict[str, Any] = {}
        self.renamed: dict[str, str] = {}

    # ---- values
    def value(self, arg):
        """The constant value of an FX argument (a literal or a ``get_attr``)."""
        if isinstance(arg, self.torch.fx.Node):
            if arg.op != "get_attr":
                raise QuantizedImportError(
                    f"{arg.name}: a scale or zero point computed at run time; only constant "
                    "qparams can be imported"
                )
            return self.fetch(arg.target)
        return arg

    def fetch(self, target: str):
        obj = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    def qparams(self, node, rule: Rule) -> tuple[FileQ, tuple]:
        a = [*node.args, None, None, None, None, None, None][:7]
        if rule.per_channel:
            scale = _numpy(self.value(a[1])).astype(np.float32).reshape(-1)
            zp = _numpy(self.value(a[2])).astype(np.int64).reshape(-1)
            axis, qmin, qmax, dtype = int(a[3]), a[4], a[5], _dtype_name(a[6])
        else:
            scale = np.asarray(_numpy(self.value(a[1])), np.float32).reshape(())
            zp = np.asarray(_numpy(self.value(a[2])), np.int64).reshape(())
            axis, qmin, qmax, dtype = None, a[3], a[4], _dtype_name(a[5])
        if dtype not in _RANGES:
            raise QuantizedImportError(f"{_label(node)}: quantized dtype {dtype} is not supported")
        return FileQ(scale, zp, dtype, axis), (int(qmin), int(qmax))

    # ---- steps
    def quantize(self, node, rule: Rule) -> None:
        qp, rng = self.qparams(node, rule)
        src = node.args[0]
        self.q_of[node] = (src, qp, rng)
        if src.op == "get_attr" and self.fetch(src.target).dtype.is_floating_point:
            # a constant quantized in the graph (fold_quantize=False): run the model's own op
            # once (torch rounds x * (1 / scale), not x / scale: the integers torch folds)
            args = [self.value(a) if isinstance(a, self.torch.fx.Node) else a for a in node.args]
            with self.torch.no_grad():
                self.folded[node] = _numpy(node.target(*args, **node.kwargs))

    def dequantize(self, node, rule: Rule) -> None:
        qp, _ = self.qparams(node, rule)
        a = node.args[0]
        if a in self.q_of and a not in self.folded:
            src, qq, qrng = self.q_of[a]
            src = self.alias.get(src, src)
            if not qp.same(qq):
                raise QuantizedImportError(
                    f"{_label(node)} dequantizes {a.name!r} with other qparams than it was "
                    "quantized with (a requantization); not supported"
                )
            if qp.axis is not None:
                raise QuantizedImportError(
                    f"{_label(node)}: per-channel quantization of the activation {src.name!r} "
                    "is not supported"
                )
            if _RANGES[qp.dtype] is not None and tuple(qrng) != _RANGES[qp.dtype]:
                raise QuantizedImportError(
                    f"{_label(a)}: the activation {src.name!r} is quantized to [{qrng[0]}, "
                    f"{qrng[1]}], not the full {qp.dtype} range; not supported (use a "
                    "quantization config without reduce_range / a restricted quant_min/max)"
                )
            self._record(src.name, qp, node)
            self.alias[node] = src
        elif a in self.folded or (
            a.op == "get_attr" and _numpy(self.fetch(a.target)).dtype.kind in "iu"
        ):
            self.alias[node] = self.integer_const(node, a, qp)
        else:
            raise QuantizedImportError(
                f"{_label(node)} dequantizes {a.name!r}, which is neither a quantize output "
                "nor an integer constant: not supported"
            )

    def _record(self, name: str, qp: FileQ, node) -> None:
        if name in self.activations and not self.activations[name].same(qp):
            raise QuantizedImportError(
                f"{_label(node)}: the tensor {name!r} is quantized twice with different qparams"
            )
        self.activations[name] = qp

    def integer_const(self, node, a, qp: FileQ) -> str:
        """The float parameter (its target) holding ``DQ(a)`` of integer constants ``a``."""
        source = self.q_of[a][0].target if a in self.folded else a.target
        if source in self.by_source:
            prev = self.consts[self.by_source[source]]
            prev.q.require_same(
                qp,
                f"{_label(node)}: the integer constant {source!r} is dequantized with two qparams",
            )
            return prev.name
        ints = self.folded[a] if a in self.folded else _numpy(self.fetch(a.target))
        name = self._param_name(node, "weight", source)
        c = FileConst(name, source, np.ascontiguousarray(ints), qp)
        self.consts[name] = c
        self.by_source[source] = name
        self.attrs[name] = c.dequantized().astype(np.float32)
        return name

    def _param_name(self, node, kind: str, fallback: str) -> str:
        """``<module path of the reading layer>.<kind>`` when free, else ``fallback``."""
        users = list(node.users)
        if len(users) == 1:
            stack = users[0].meta.get("nn_module_stack") or {}
            if stack:
                path = list(stack.values())[-1][0]
                name = f"{path}.{kind}" if path else kind
                if name not in self.attrs:
                    return name
        return fallback.replace(".", "_") if fallback in self.attrs else fallback

    # ---- the float graph
    def copy(self, node):
        """``node`` into the float graph (inputs through the aliases)."""
        torch = self.torch

        def arg(n):
            n = self.alias.get(n, n)
            if isinstance(n, str):  # a float parameter made here
                return self.get_attr(n)
            return self.env[n]

        if node.op == "call_module":
            if node.target == "_guards_fn":  # torch.export's input guards: not computation
                return
            self.attrs[node.target] = self.fetch(node.target)
        if node.op == "get_attr":
            t = self.fetch(node.target)
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                name = self._bias_name(node)
                self.attrs[name] = _numpy(t).astype(np.float32, copy=True)
                self.env[node] = self.get_attr(name)
                return
            self.attrs[node.target] = t
        self.env[node] = self.graph.node_copy(node, arg)

    def _bias_name(self, node) -> str:
        users = list(node.users)
        if len(users) == 1 and node is (users[0].args + (None,) * 3)[2]:
            return self._param_name(node, "bias", node.target)
        return node.target

    def get_attr(self, name: str):
        node = self.renamed.get(name)
        if node is None:
            node = self.graph.get_attr(name)
            self.renamed[name] = node
        return node


def _as_graph_module(model, example_inputs):
    import torch

    if isinstance(model, torch.export.ExportedProgram):
        if example_inputs is None and model.example_inputs is not None:
            example_inputs = model.example_inputs[0]
        model = model.module()
    if not isinstance(model, torch.fx.GraphModule):
        raise QuantizedImportError(
            f"import_quantized takes a PT2E-converted torch.fx.GraphModule or an "
            f"ExportedProgram of one, got {type(model).__name__}; quantize with torchao's "
            "prepare_pt2e -> calibrate -> convert_pt2e first"
        )
    if example_inputs is None:
        raise QuantizedImportError(
            "import_quantized(torch model) needs example_inputs (the shapes to import with)"
        )
    return model, example_inputs


def _outputs(reader: _Reader, out_node) -> tuple[list, list[str], dict, set]:
    """The original outputs in the float graph, their names, and which the model quantizes."""
    import torch

    args = out_node.args[0]
    flat = list(args) if isinstance(args, list | tuple) else [args]
    fields, names, int_outputs, dq_outputs = [], [], {}, set()
    for k, n in enumerate(flat):
        if not isinstance(n, torch.fx.Node):
            raise QuantizedImportError(f"output {k} is not a tensor ({n!r}); not supported")
        if n in reader.q_of:  # the model outputs integers
            src, qp, _ = reader.q_of[n]
            src = reader.alias.get(src, src)
            reader._record(src.name, qp, n)
            int_outputs[k] = qp
            n = src
        elif n in reader.alias and not isinstance(reader.alias[n], str):
            dq_outputs.add(k)
            n = reader.alias[n]
        fields.append(reader.env[n])
        names.append(n.name)
    return fields, names, int_outputs, dq_outputs


def _labels(gm, reader: _Reader) -> tuple[dict[str, str], dict[str, list[str]]]:
    producer: dict[str, str] = {}
    consumers: dict[str, list[str]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.op != "call_function" or str(n.target).startswith(_QD):
            continue
        producer[n.name] = _label(n)
        for a in n.all_input_nodes:
            a = reader.alias.get(a, a)
            if not isinstance(a, str):
                consumers[a.name].append(_label(n))
    return producer, dict(consumers)


def _raw_readers(gm, r: _Reader) -> list[str]:
    """Ops that read a tensor the model quantizes in float (not through its dequantize)."""
    notes = []
    for src, _, _ in r.q_of.values():
        for u in src.users:
            if _rule(u) is None and u.op != "output" and src.name in r.activations:
                notes.append(
                    f"{_label(u)} reads {src.name} in float, which the model also quantizes: "
                    "the imported module reads the quantized value (one value per tensor), "
                    "at most half a step of its scale apart"
                )
    return sorted(set(notes))


def split_pt2e(model, example_inputs=None) -> tuple[FloatGraph, tuple]:
    """The float graph of a PT2E-converted model plus its quantization (module doc).

    Returns the :class:`FloatGraph` and the example inputs (a tuple of tensors)."""
    import torch

    gm, example_inputs = _as_graph_module(model, example_inputs)
    r = _Reader(gm)
    out_node = None
    for node in gm.graph.nodes:
        if node.op == "output":
            out_node = node
            continue
        rule = _rule(node)
        if rule is None:
            if node.op == "get_attr" and all(_rule(u) is not None for u in node.users):
                continue  # read by the Q/DQ rules only
            r.copy(node)
        elif rule.kind == "quantize":
            r.quantize(node, rule)
        else:
            r.dequantize(node, rule)
    for node in r.q_of:
        bad = [u for u in node.users if (_rule(u) is None or _rule(u).kind != "dequantize")]
        if bad and not (len(bad) == 1 and bad[0].op == "output"):
            raise QuantizedImportError(
                f"{_label(bad[0])} reads the quantized integers of {_label(node)} directly; "
                "only dequantize ops may"
            )
    fields, names, int_outputs, dq_outputs = _outputs(r, out_node)
    extras = [t for t in r.activations if t not in set(names)]
    by_name = {n.name: n for n in gm.graph.nodes}
    r.graph.output(tuple(fields + [r.env[by_name[t]] for t in extras]))
    root = {
        k: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(v)), requires_grad=False)
        if isinstance(v, np.ndarray)
        else v
        for k, v in r.attrs.items()
    }
    float_gm = torch.fx.GraphModule(root, r.graph)
    producer, consumers = _labels(gm, r)
    split = SplitResult(
        model=None,
        n_outputs=len(fields),
        extra_outputs=extras,
        activations=r.activations,
        consts=r.consts,
        int_inputs={},
        int_outputs=int_outputs,
        dq_outputs=dq_outputs,
        producer=producer,
        consumers=consumers,
        output_names=names + extras,
    )
    if not isinstance(example_inputs, tuple | list | dict):
        example_inputs = (example_inputs,)
    return FloatGraph(float_gm, split, _raw_readers(gm, r)), example_inputs
