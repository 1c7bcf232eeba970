"""ONNX ``LSTM``, ``GRU`` and ``RNN`` rewritten into ops TVM imports, unrolled over the static
sequence length (TVM 0.27's ONNX importer has no converter for any of the three).

Each node becomes, per direction: one ``MatMul`` of the whole input sequence by the
transposed input weights ``W^T`` (all gates at once, ``[I, G*H]``, so a per-output-channel
weight grid is per gate and per channel) plus the input bias, then per time step a ``Slice``
of that projection, a ``MatMul`` of the previous hidden state by the transposed recurrent
weights ``R^T`` (the same initializer at every step) and the gate arithmetic (``Sigmoid``,
``Tanh``, ``Mul``, ``Add``), exactly as the ONNX operator documents it:

* LSTM gates in ONNX order ``i o f c``; peepholes ``P``; ``input_forget``; ``clip``.
* GRU gates ``z r h``; ``linear_before_reset`` (torch writes 1) keeps ``Rb_h`` inside the
  reset product, 0 moves the reset before the recurrent ``MatMul`` of the ``h`` gate.
* RNN: one gate.
* ``direction`` forward, reverse or bidirectional (both directions, outputs concatenated on
  the direction axis); ``layout`` 0 or 1; ``initial_h`` / ``initial_c`` constant or inputs
  (state in, state out: the outputs ``Y_h`` / ``Y_c`` are the state after the last step);
  ``activations`` by name with the ONNX ops' default parameters.

The sequence length and batch come from the fixed input shapes; ``sequence_lens``, when
given, must be a constant (or a ``constant_inputs`` value) equal to the full length for every
batch row. Anything else (per-row lengths, ``activation_alpha``) is an error naming the node.
"""

from __future__ import annotations

import numpy as np

from autoq.frontends.errors import FrontendError
from autoq.naming import unique_name

__all__ = ["RECURRENT_OPS", "rewrite_recurrent"]

#: activation names the rewrite writes as the ONNX op of that name (default parameters)
_ACTIVATIONS = {
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "relu": "Relu",
    "softsign": "Softsign",
    "softplus": "Softplus",
    "hardsigmoid": "HardSigmoid",
    "leakyrelu": "LeakyRelu",
    "elu": "Elu",
    "thresholdedrelu": "ThresholdedRelu",
}


class _Emit:
    """New nodes and initializers for one rewritten node, names unique under ``prefix``."""

    def __init__(self, prefix: str, opset: int, taken: set[str]):
        self.prefix, self.opset, self.taken = prefix, opset, taken
        self.nodes: list = []
        self.inits: list = []

    def name(self, hint: str) -> str:
        return unique_name(f"{self.prefix}/{hint}", self.taken)

    def const(self, array: np.ndarray, hint: str) -> str:
        from onnx import numpy_helper

        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, inputs, hint: str | None = None, out: str | None = None, **attrs):
        from onnx import helper

        out = out or self.name(hint or op_type.lower())
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [out], name=self.name(op_type), **attrs)
        )
        return out

    def reshape(self, x: str, shape) -> str:
        return self.op("Reshape", [x, self.const(np.asarray(shape, np.int64), "shape")])

    def slice(self, x: str, start: int, stop: int, axis: int) -> str:
        if self.opset < 10:
            return self.op("Slice", [x], starts=[start], ends=[stop], axes=[axis])
        ints = [self.const(np.asarray([v], np.int64), "slice") for v in (start, stop, axis)]
        return self.op("Slice", [x, *ints])

    def add(self, a: str | None, b: str | None) -> str | None:
        if a is None or b is None:
            return a if b is None else b
        return self.op("Add", [a, b])

    def mul(self, a: str, b: str) -> str:
        return self.op("Mul", [a, b])

    def clip(self, x: str, bound: float | None, dtype) -> str:
        if bound is None:
            return x
        if self.opset < 11:
            return self.op("Clip", [x], min=-bound, max=bound)
        lo = self.const(np.asarray(-bound, dtype), "clip_min")
        hi = self.const(np.asarray(bound, dtype), "clip_max")
        return self.op("Clip", [x, lo, hi])


class _Node:
    """The attributes, constant inputs and static shape of one recurrent node."""

    def __init__(self, node, consts: dict, shape_of, gates: int, default_acts):
        from onnx import helper

        self.node = node
        self.label = f"{node.op_type} node {node.name!r}" if node.name else node.op_type
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.direction = attrs.get("direction", b"forward")
        self.direction = (
            self.direction.decode() if isinstance(self.direction, bytes) else self.direction
        )
        if self.direction not in ("forward", "reverse", "bidirectional"):
            self.fail(f"direction {self.direction!r} is not an ONNX direction")
        self.num_dir = 2 if self.direction == "bidirectional" else 1
        self.layout = int(attrs.get("layout", 0))
        clip = attrs.get("clip")
        self.clip = float(clip) if clip is not None else None
        self.input_forget = int(attrs.get("input_forget", 0))
        self.linear_before_reset = int(attrs.get("linear_before_reset", 0))
        if attrs.get("activation_alpha") or attrs.get("activation_beta"):
            self.fail(
                "activation_alpha / activation_beta are not supported (only the activation "
                "ops' default parameters)"
            )
        names = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
        names = names or list(default_acts) * self.num_dir
        if len(names) != len(default_acts) * self.num_dir:
            self.fail(f"{len(names)} activations for {self.num_dir} direction(s)")
        self.acts = []
        for a in names:
            if a.lower() not in _ACTIVATIONS:
                self.fail(f"activation {a!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
            self.acts.append(_ACTIVATIONS[a.lower()])
        inputs = list(node.input) + [""] * (8 - len(node.input))
        self.x = inputs[0]
        self.w = self.constant(consts, inputs[1], "W")
        self.r = self.constant(consts, inputs[2], "R")
        self.dtype = self.w.dtype
        self.hidden = int(attrs.get("hidden_size", self.r.shape[-1]))
        g = gates * self.hidden
        if self.w.shape[:2] != (self.num_dir, g) or self.r.shape != (self.num_dir, g, self.hidden):
            self.fail(
                f"W {self.w.shape} / R {self.r.shape} do not fit hidden_size {self.hidden}, "
                f"{gates} gates and {self.num_dir} direction(s)"
            )
        b = self.constant(consts, inputs[3], "B") if inputs[3] else None
        self.b = np.zeros((self.num_dir, 2 * g), self.dtype) if b is None else b
        self.names = {"W": inputs[1], "R": inputs[2], "B": inputs[3]}
        shape = shape_of(self.x)
        if shape is None or len(shape) != 3 or not all(isinstance(d, int) for d in shape):
            self.fail(
                f"the static shape of its input {self.x!r} is unknown ({shape}); fix the "
                "model's input shapes with input_shapes"
            )
        self.seq, self.batch = (shape[1], shape[0]) if self.layout else (shape[0], shape[1])
        self.input_size = shape[2]
        if inputs[4]:
            lens = consts.get(inputs[4])
            if lens is None:
                self.fail(
                    f"its sequence_lens {inputs[4]!r} is not a constant: autoq unrolls the "
                    "sequence to its static length; fix it with constant_inputs (all rows "
                    "full length) or export the model without sequence_lens"
                )
            if np.any(np.asarray(lens) != self.seq):
                self.fail(
                    f"sequence_lens {np.asarray(lens).tolist()} differ from the sequence "
                    f"length {self.seq}: only full-length sequences are supported"
                )
        # an all-zero constant state (torch's default) is no state: step 0 skips its terms
        self.initial_h, self.initial_c = (
            None if not x or (x in consts and not np.any(consts[x])) else x
            for x in (inputs[5], inputs[6])
        )
        self.p = self.constant(consts, inputs[7], "P") if inputs[7] else None

    def fail(self, why: str):
        raise FrontendError(f"{self.label}: {why}")

    def constant(self, consts: dict, name: str, role: str) -> np.ndarray:
        if name not in consts:
            self.fail(
                f"its {role} input {name!r} is not a constant: autoq needs the recurrent "
                "weights as initializers"
            )
        return np.asarray(consts[name])


def _act(e: _Emit, op_type: str, x: str, clip, dtype) -> str:
    return e.op(op_type, [e.clip(x, clip, dtype)])


def _state(e: _Emit, n: _Node, name: str | None, d: int) -> str | None:
    """Direction ``d`` of an initial state ``[num_dir, batch, H]`` as ``[batch, H]``."""
    if name is None:
        return None
    if n.num_dir == 1:
        return e.reshape(name, [n.batch, n.hidden])
    return e.reshape(e.slice(name, d, d + 1, 0), [n.batch, n.hidden])


def _lstm_step(e: _Emit, n: _Node, d: int, xt: str, h, c, rt: str, one: str):
    hs = n.hidden
    f, g, hact = n.acts[3 * d : 3 * d + 3]
    gates = e.add(xt, None if h is None else e.op("MatMul", [h, rt]))
    i, o, fg, cc = (e.slice(gates, k * hs, (k + 1) * hs, 1) for k in range(4))
    if n.p is not None and c is not None:
        i = e.add(i, e.mul(c, e.const(n.p[d, :hs], "p_i")))
        fg = e.add(fg, e.mul(c, e.const(n.p[d, 2 * hs :], "p_f")))
    i = _act(e, f, i, n.clip, n.dtype)
    fg = e.op("Sub", [one, i]) if n.input_forget else _act(e, f, fg, n.clip, n.dtype)
    cc = _act(e, g, cc, n.clip, n.dtype)
    c_new = e.mul(i, cc) if c is None else e.add(e.mul(fg, c), e.mul(i, cc))
    if n.p is not None:
        o = e.add(o, e.mul(c_new, e.const(n.p[d, hs : 2 * hs], "p_o")))
    o = _act(e, f, o, n.clip, n.dtype)
    return e.mul(o, e.op(hact, [c_new])), c_new


def _gru_step(e: _Emit, n: _Node, d: int, xt: str, h, rt, one: str, rb: tuple):
    hs = n.hidden
    f, g = n.acts[2 * d : 2 * d + 2]
    xz, xr, xh = (e.slice(xt, k * hs, (k + 1) * hs, 1) for k in range(3))
    if h is None:
        z, r = _act(e, f, xz, n.clip, n.dtype), _act(e, f, xr, n.clip, n.dtype)
        pre = e.add(xh, e.mul(r, rb[1])) if n.linear_before_reset else xh
        return e.mul(e.op("Sub", [one, z]), _act(e, g, pre, n.clip, n.dtype))
    if n.linear_before_reset:
        rec = e.add(e.op("MatMul", [h, rt]), rb[0])
        rz, rr, rh = (e.slice(rec, k * hs, (k + 1) * hs, 1) for k in range(3))
        z, r = (
            _act(e, f, e.add(xz, rz), n.clip, n.dtype),
            _act(e, f, e.add(xr, rr), n.clip, n.dtype),
        )
        pre = e.add(xh, e.mul(r, rh))
    else:
        rzr, rh_t = rt
        rec = e.op("MatMul", [h, rzr])
        rz, rr = (e.slice(rec, k * hs, (k + 1) * hs, 1) for k in range(2))
        z, r = (
            _act(e, f, e.add(xz, rz), n.clip, n.dtype),
            _act(e, f, e.add(xr, rr), n.clip, n.dtype),
        )
        pre = e.add(xh, e.op("MatMul", [e.mul(r, h), rh_t]))
    hh = _act(e, g, pre, n.clip, n.dtype)
    return e.add(e.mul(e.op("Sub", [one, z]), hh), e.mul(z, h))


def _direction(e: _Emit, n: _Node, d: int, x_seq: str) -> tuple[list[str], str, str | None]:
    """One direction: the hidden state at every position, the last hidden and cell state."""
    op = n.node.op_type
    hs, g = n.hidden, n.w.shape[1]
    wb, rbias = n.b[d, :g], n.b[d, g:]
    xbias = wb + rbias
    rb = ()
    if op == "GRU" and n.linear_before_reset:
        # Rb_h stays inside the reset product: the recurrent MatMul's bias [0, 0, Rb_h]
        xbias = np.concatenate([wb[: 2 * hs] + rbias[: 2 * hs], wb[2 * hs :]])
        rb = (
            e.const(np.concatenate([np.zeros(2 * hs, n.dtype), rbias[2 * hs :]]), "r_bias"),
            e.const(rbias[2 * hs :], "r_bias_h"),
        )
    tag = ("forward", "reverse")[d] if n.num_dir == 2 else n.direction
    w_t = e.const(n.w[d].T, f"{tag}/input_weight")
    proj = e.add(e.op("MatMul", [x_seq, w_t]), e.const(xbias.astype(n.dtype), f"{tag}/bias"))
    r_t = n.r[d].T
    if op == "GRU" and not n.linear_before_reset:
        rt = (
            e.const(r_t[:, : 2 * hs], f"{tag}/recurrent_weight_zr"),
            e.const(r_t[:, 2 * hs :], f"{tag}/recurrent_weight_h"),
        )
    else:
        rt = e.const(r_t, f"{tag}/recurrent_weight")
    one = e.const(np.asarray(1, n.dtype), "one")
    h = _state(e, n, n.initial_h, d)
    c = _state(e, n, n.initial_c, d) if op == "LSTM" else None
    steps = range(n.seq) if tag != "reverse" else range(n.seq - 1, -1, -1)
    ys: dict[int, str] = {}
    for t in steps:
        xt = e.reshape(e.slice(proj, t, t + 1, 0), [n.batch, g])
        if op == "LSTM":
            h, c = _lstm_step(e, n, d, xt, h, c, rt, one)
        elif op == "GRU":
            h = _gru_step(e, n, d, xt, h, rt, one, rb)
        else:
            pre = e.add(xt, None if h is None else e.op("MatMul", [h, rt]))
            h = _act(e, n.acts[d], pre, n.clip, n.dtype)
        ys[t] = h
    return [ys[t] for t in range(n.seq)], h, c


def _rewrite(n: _Node, e: _Emit) -> list:
    node = n.node
    x_seq = e.op("Transpose", [n.x], perm=[1, 0, 2]) if n.layout else n.x
    results = [_direction(e, n, d, x_seq) for d in range(n.num_dir)]
    outs = list(node.output) + [""] * (3 - len(node.output))
    b, hs = n.batch, n.hidden

    def stacked(values, shape, axis):
        parts = [e.reshape(v, shape) for v in values]
        return parts[0] if len(parts) == 1 else e.op("Concat", parts, axis=axis)

    if outs[0]:
        per_dir = [stacked(ys, [1, 1, b, hs], 0) for ys, _, _ in results]
        y = per_dir[0] if n.num_dir == 1 else e.op("Concat", per_dir, axis=1)
        if n.layout:
            y = e.op("Transpose", [y], perm=[2, 0, 1, 3])
        e.op("Identity", [y], out=outs[0])
    for k, pick in ((1, 1), (2, 2)):
        if k < len(outs) and outs[k]:
            if k == 2 and node.op_type != "LSTM":
                n.fail("only LSTM has a third output")
            state = stacked([r[pick] for r in results], [1, b, hs], 0)
            if n.layout:
                state = e.op("Transpose", [state], perm=[1, 0, 2])
            e.op("Identity", [state], out=outs[k])
    return e.nodes


#: op type -> (gates, default activations of one direction)
RECURRENT_OPS = {
    "LSTM": (4, ("Sigmoid", "Tanh", "Tanh")),
    "GRU": (3, ("Sigmoid", "Tanh")),
    "RNN": (1, ("Tanh",)),
}


def _constants(model) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return consts


def _shapes(model):
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model onnx cannot infer: fall back to the declared shapes
        inferred = model
    out = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    return out.get


def rewrite_recurrent(model) -> int:
    """Rewrite every top-level LSTM / GRU / RNN node of ``model`` (in place, see the module
    docstring); the number rewritten. Terms of constant states (``h0 @ R^T``) are left for
    ONNX Runtime's constant folding to fold. Raises :class:`FrontendError` naming a node that
    cannot be unrolled."""
    if not any(node.op_type in RECURRENT_OPS for node in model.graph.node):
        return 0
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    consts, shape_of = _constants(model), _shapes(model)
    taken = {o for node in model.graph.node for o in node.output}
    taken |= {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    taken |= {node.name for node in model.graph.node}
    new_nodes, count = [], 0
    for k, node in enumerate(model.graph.node):
        if node.op_type not in RECURRENT_OPS or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        gates, acts = RECURRENT_OPS[node.op_type]
        n = _Node(node, consts, shape_of, gates, acts)
        e = _Emit(node.name or f"{node.op_type.lower()}_{k}", opset, taken)
        new_nodes.extend(_rewrite(n, e))
        model.graph.initializer.extend(e.inits)
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return count
