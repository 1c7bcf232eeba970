"""The ONNX graph the export writes, and what each Relax value of the realized module is in it.

:class:`Graph` collects nodes and initializers: identical constants become one initializer,
identical nodes one node (so a tensor dequantized for three readers is dequantized once), and
nodes whose outputs nothing reads are dropped when the model is assembled.

A Relax value is one of three kinds in the ONNX graph:

* :class:`Int`: an integer tensor holding exactly autoq's integers (int8 / uint8 / int16
  activations, int32 zero points, integer constants) plus ``shift``: autoq's int8
  activations are written as uint8 ``q + 128`` with zero point ``zp + 128`` (the same real
  values; OpenVINO's CPU plugin has no kernel for some int8 activation / zero point
  combinations, and ONNX Runtime's x86 kernels are fastest with uint8 activations);
* :class:`Float`: a float32 tensor holding autoq's float values;
* :class:`Acc`: an int32 accumulator of autoq (``qnn.conv2d``, ``qnn.dense``, ...) held as a
  float32 tensor ``acc * scale`` (the QDQ form: ``Conv(DequantizeLinear(x),
  DequantizeLinear(w))`` computes the real value of the accumulator, not its integer);
  ``scale`` is a constant array broadcast along ``axis``. ``bias_node``: the Conv / Gemm
  node that computed it while it can still take a bias input.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from autoq.naming import unique_name

__all__ = ["Acc", "Float", "Graph", "Int", "Value"]


@dataclass(frozen=True)
class Int:
    name: str
    dtype: str  # autoq's dtype
    shift: int = 0  # the ONNX tensor holds autoq's integers + shift (128: int8 as uint8)

    @property
    def onnx_dtype(self) -> str:
        return "uint8" if self.shift == 128 and self.dtype == "int8" else self.dtype


@dataclass(frozen=True)
class Float:
    name: str


@dataclass(frozen=True)
class Acc:
    name: str
    scale: np.ndarray  # float32, 0-d or 1-D along ``axis``
    axis: int  # non-negative; ignored for a 0-d scale
    rank: int
    bias_node: onnx.NodeProto | None = None

    def __hash__(self):  # the arrays are not hashable; values are compared by identity
        return id(self)

    def __eq__(self, other):
        return self is other


Value = Int | Float | Acc | tuple


class Graph:
    """Nodes and initializers of the exported model (see the module docstring)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self._consts: dict[tuple, str] = {}
        self._cse: dict[tuple, list[str]] = {}
        self._names: set[str] = set()

    def fresh(self, hint: str) -> str:
        return unique_name(hint or "t", self._names)

    def reserve(self, name: str) -> None:
        """Keep ``name`` (a model input) from being given to another tensor."""
        self._names.add(name)

    def const(self, array, dtype=None, hint: str = "c") -> str:
        """The initializer holding ``array`` (one per distinct dtype, shape and bytes)."""
        array = np.array(array, dtype, order="C")  # (ascontiguousarray makes 0-d 1-D)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = self.fresh(hint)
            self.initializers[name] = numpy_helper.from_array(array, name)
            self._consts[key] = name
        return self._consts[key]

    def node(self, op: str, inputs, hint: str = "t", outputs: int = 1, share: bool = True, **attrs):
        """Add a node (or return the identical one made before, ``share``); its output name,
        or the list of names when ``outputs > 1``."""
        inputs = list(inputs)
        key = (op, tuple(inputs), outputs, repr(sorted(attrs.items())))
        if share and key in self._cse:
            names = self._cse[key]
        else:
            names = [self.fresh(hint) for _ in range(outputs)]
            self.nodes.append(helper.make_node(op, inputs, names, name=names[0], **attrs))
            if share:
                self._cse[key] = names
        return names if outputs > 1 else names[0]

    def output(self, source: str, name: str) -> None:
        """Name a model output: an ``Identity`` from ``source`` to ``name`` (reserved)."""
        self.nodes.append(helper.make_node("Identity", [source], [name], name=name))

    def model(self, inputs, outputs, opset: int) -> onnx.ModelProto:
        """The model: ``inputs`` / ``outputs`` are ``onnx.ValueInfoProto``; unread nodes and
        initializers are dropped."""
        live = {o.name for o in outputs}
        kept = []
        known = {i.name for i in inputs} | set(self.initializers)
        for node in reversed(_topological(self.nodes, known)):
            if any(o in live for o in node.output):
                kept.append(node)
                live.update(i for i in node.input if i)
        kept.reverse()
        inits = [t for name, t in self.initializers.items() if name in live]
        graph = helper.make_graph(kept, "autoq", inputs, outputs, initializer=inits)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="autoq"
        )
        model.ir_version = 10
        return model


def _topological(nodes: list, known: set) -> list:
    """``nodes`` in an order where each node comes after the producers of its inputs (a bias
    input is appended to a Conv after the Conv was made), otherwise in the given order."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    waits = [{producer[i] for i in n.input if i and i not in known} for n in nodes]
    readers: dict[int, list[int]] = {}
    for k, deps in enumerate(waits):
        for d in deps:
            readers.setdefault(d, []).append(k)
    ready = [k for k, deps in enumerate(waits) if not deps]
    heapq.heapify(ready)
    out = []
    while ready:
        k = heapq.heappop(ready)
        out.append(nodes[k])
        for r in readers.get(k, ()):
            waits[r].discard(k)
            if not waits[r]:
                heapq.heappush(ready, r)
    if len(out) != len(nodes):
        raise ValueError("the exported graph has a cycle")
    return out
