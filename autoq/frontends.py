"""Model import: ONNX files and PyTorch modules to a Relax ``IRModule`` plus named weights.

Both frontends return ``(mod, params)``: ``mod["main"]`` takes the model's data inputs first
and then one parameter per weight; ``params`` maps each weight parameter's name to a numpy
array. Everything autoq reports (layer ids, fallback rules, overrides) is spelled with those
names, so they are the names the user knows:

* ONNX: the initializer names in the file (``conv1.weight``, ``onnx::Conv_4202``,
  ``conv2d_0.w_0``: whatever the exporter wrote). TVM's importer strips a leading ``onnx::``;
  :func:`from_onnx` puts it back. When ONNX Runtime's optimizer fused a node into a
  convolution it prefixes the initializer (``ConvBnFusion_W_conv2d_0.w_0``); the prefix is
  removed again, so the folded weight keeps the convolution's own name. Data inputs keep their
  ONNX names exactly (no sanitizing), so datasets use the same keys as ONNX Runtime.
* PyTorch: module paths from ``named_parameters()`` (``layer1.0.conv1.weight``), not the
  exporter's placeholder names (``p_layer1_0_conv1_weight``).

Decisions (see also the function docstrings):

* **Static input shapes.** Calibration, layout and the compiled kernels want static shapes,
  and TVM's ONNX importer fails on many real models while any input dimension is symbolic.
  :func:`from_onnx` therefore requires every data input to end up static: dynamic dimensions
  are fixed from ``input_shapes`` (with :func:`onnx.tools.update_model_dims.
  update_inputs_outputs_dims`), and a clear error lists the inputs that still need one.
* **Constant folding by ONNX Runtime.** Real exports carry shape arithmetic
  (``Shape``/``Gather``/``Concat`` feeding ``Reshape``/``Pad``) and weights stored as
  ``Constant`` nodes; TVM imports them only once they are folded. :func:`from_onnx` runs ONNX
  Runtime's *basic* graph optimizations (constant folding, redundant node elimination and the
  value-preserving Conv+BatchNorm/Mul/Add fusions; only standard ONNX ops result) and imports
  the optimized model. ``optimize=False`` imports the file as it is. ONNX Runtime becomes a
  dependency of autoq.
* **What is a parameter.** Floating-point initializers become named parameters when they are
  the weight or bias of ``Conv``/``ConvTranspose``/``Gemm``/``MatMul`` or hold more than one
  element. Scalars (clip bounds, ``Pow`` exponents, epsilons) and integer tensors (shapes,
  axes, indices) are bound as constants: they are not weights, and as constants TVM can fold
  them. Parameters the imported graph does not use are dropped.
* **Batch norm.** Whatever ``relax.nn.batch_norm`` survives import is folded into the
  preceding convolution by :func:`autoq.prepare.fold_batch_norm`, and batch norms written as
  per-channel ``Sub``/``Mul``/``Add`` chains (Caffe-origin models such as Open-NSFW) by
  :func:`autoq.prepare.fold_affine` (``fold_bn=False`` keeps both).
* **Errors.** Operators TVM's importer cannot convert are listed by type, with counts and a
  node name each, before any work; QOperator-format quantized models (``QLinearConv`` ...) get
  a hint. When a supported operator fails to convert, the error names the ONNX node.
* **torch is optional** and imported lazily by :func:`from_torch` (extra ``autoq[torch]``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .prepare import drop_unused_params, fold_affine, fold_batch_norm, rebind, rename_params
from .toolkit import with_main

__all__ = [
    "FrontendError",
    "QuantizedModelError",
    "UnsupportedOpsError",
    "from_onnx",
    "from_torch",
    "load_onnx",
    "onnx_input_shapes",
    "strip_fusion_prefix",
    "unsupported_onnx_ops",
]


class FrontendError(RuntimeError):
    """A model could not be imported; the message says what blocked it and what to do."""


class QuantizedModelError(FrontendError):
    """The ONNX model is already quantized (QuantizeLinear/DequantizeLinear nodes): use
    :func:`autoq.import_quantized` (or ``from_onnx(..., allow_quantized=True)``)."""


class UnsupportedOpsError(FrontendError, NotImplementedError):
    """The model uses operators that TVM's importer cannot convert (``.ops``: type -> nodes)."""

    def __init__(self, message: str, ops: dict[str, list[str]]):
        super().__init__(message)
        self.ops = ops


# Initializers renamed by ONNX Runtime's fusions carry the original name after one of these.
_ORT_FUSION_PREFIX = re.compile(
    r"^(?:ConvBnFusion_(?:W|BN_B)_|ConvMulFusion_(?:W|Mul_B)_|ConvAddFusion_(?:Add_B|B)_"
    r"|MatMulBnFusion_Gemm(?:B|Bias)_)"
)
_QOPERATOR = ("ConvInteger", "MatMulInteger", "QGemm")
_WEIGHT_CONSUMERS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,)}
# models whose initializers exceed this are written with external data for ONNX Runtime
_EXTERNAL_DATA_BYTES = 1 << 30


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------


def load_onnx(path_or_model, caller: str = "from_onnx"):
    """An ``onnx.ModelProto`` from a path, a ModelProto (copied: the caller's model is never
    modified) or serialized bytes; ``caller`` names the public function in the errors."""
    import onnx

    if isinstance(path_or_model, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(path_or_model)  # never modify the caller's model
        return model
    if isinstance(path_or_model, bytes | bytearray):
        return onnx.load_from_string(bytes(path_or_model))
    if isinstance(path_or_model, str | os.PathLike):
        path = Path(path_or_model)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX file at {str(path)!r}")
        return onnx.load(str(path))
    raise TypeError(
        f"{caller} takes a path, an onnx.ModelProto or bytes, got {type(path_or_model).__name__}"
    )


def _data_inputs(model) -> list:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _declared(vi) -> list[int | str | None] | None:
    """Declared dims of a graph input: int when static, the dim_param (or None) when not."""
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            out.append(int(d.dim_value))
        else:
            out.append(d.dim_param or None)
    return out


def _fmt_dims(dims) -> str:
    if dims is None:
        return "(unknown rank)"
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def onnx_input_shapes(path_or_model) -> dict[str, tuple]:
    """The declared shapes of an ONNX model's data inputs (symbolic dims as names or None)."""
    model = load_onnx(path_or_model)
    return {i.name: tuple(_declared(i) or ()) for i in _data_inputs(model)}


def _resolve_shapes(model, input_shapes) -> dict[str, tuple[int, ...]]:
    inputs = _data_inputs(model)
    declared = {i.name: _declared(i) for i in inputs}
    for i in inputs:
        if not i.type.HasField("tensor_type"):
            raise FrontendError(
                f"input {i.name!r} is not a tensor; only tensor inputs are supported"
            )
    listing = ", ".join(f"{n!r} {_fmt_dims(d)}" for n, d in declared.items())
    given = dict(input_shapes or {})
    if not isinstance(given, dict):
        raise TypeError("input_shapes must be a dict {input name: shape tuple}")
    unknown = [n for n in given if n not in declared]
    if unknown:
        raise ValueError(
            f"input_shapes names {unknown} are not data inputs of the model; its inputs are: {listing}"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    missing = []
    for name, dims in declared.items():
        if name in given:
            shape = given[name]
            if not isinstance(shape, Sequence) or isinstance(shape, str):
                raise ValueError(f"input_shapes[{name!r}] must be a tuple of ints, got {shape!r}")
            if not all(isinstance(d, int | np.integer) and d > 0 for d in shape):
                raise ValueError(
                    f"input_shapes[{name!r}] = {tuple(shape)}: every dimension must be a positive int"
                )
            shape = tuple(int(d) for d in shape)
            if dims is not None:
                if len(dims) != len(shape):
                    raise ValueError(
                        f"input {name!r} has rank {len(dims)} {_fmt_dims(dims)} in the model, "
                        f"input_shapes gives rank {len(shape)} {shape}"
                    )
                for k, (d, s) in enumerate(zip(dims, shape, strict=True)):
                    if isinstance(d, int) and d != s:
                        raise ValueError(
                            f"input {name!r} dimension {k} is fixed to {d} in the model "
                            f"{_fmt_dims(dims)}; input_shapes gives {s}"
                        )
            shapes[name] = shape
        elif dims is None or any(not isinstance(d, int) for d in dims):
            missing.append(name)
        else:
            shapes[name] = tuple(dims)
    if missing:
        example = ", ".join(
            f"{n!r}: ({', '.join(str(d) if isinstance(d, int) else '...' for d in (declared[n] or ['...']))})"
            for n in missing
        )
        raise ValueError(
            "autoq needs static input shapes; these inputs have dynamic dimensions: "
            + ", ".join(f"{n!r} {_fmt_dims(declared[n])}" for n in missing)
            + f". Pass input_shapes={{{example}}} with the sizes filled in."
        )
    return shapes


def _fix_input_shapes(model, shapes: dict[str, tuple[int, ...]]) -> None:
    """Write the static shapes into the model's inputs (in place), with onnx's own tool."""
    import onnx
    from onnx.tools.update_model_dims import update_inputs_outputs_dims

    for vi in list(model.graph.input) + list(model.graph.output):
        tt = vi.type.tensor_type
        if vi.name in shapes and not tt.HasField("shape"):
            for _ in shapes[vi.name]:
                tt.shape.dim.add()
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.Clear()  # exporters write -1 for "dynamic"; ONNX says leave it unset
    input_dims = {i.name: list(shapes[i.name]) for i in _data_inputs(model)}
    init_names = {t.name for t in model.graph.initializer}
    for i in model.graph.input:  # old models also list initializers as inputs
        if i.name in init_names:
            input_dims[i.name] = [d.dim_value for d in i.type.tensor_type.shape.dim]
    output_dims = {}
    for o in model.graph.output:
        output_dims[o.name] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or -1)
            for d in o.type.tensor_type.shape.dim
        ]
    try:
        update_inputs_outputs_dims(model, input_dims, output_dims)
    except onnx.checker.ValidationError:
        # the dims are already written; the checker is stricter than ONNX Runtime and TVM
        pass


def _ort_optimize(model, workdir: Path):
    """Constant folding and value-preserving fusions by ONNX Runtime (basic level)."""
    import onnx

    try:
        import onnxruntime as ort
    except ImportError:
        raise ImportError(
            "from_onnx folds constants with ONNX Runtime: pip install onnxruntime "
            "(or autoq[onnx]); pass optimize=False to import the model as it is"
        ) from None
    src = workdir / "fixed.onnx"
    dst = workdir / "optimized.onnx"
    init_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    external = init_bytes > _EXTERNAL_DATA_BYTES
    onnx.save_model(model, str(src), save_as_external_data=external, location="fixed.onnx.data")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 3
    if external:
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.onnx.data"
        )
    try:
        ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise FrontendError(
            f"ONNX Runtime could not load the model to fold its constants: {e}\n"
            "Pass optimize=False to import the model without ONNX Runtime."
        ) from e
    return onnx.load(str(dst))


def _walk_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.g is not None and attr.HasField("g"):
                yield from _walk_nodes(attr.g)
            for g in attr.graphs:
                yield from _walk_nodes(g)


def unsupported_onnx_ops(path_or_model) -> dict[str, list[str]]:
    """Operator types (with ``domain.`` prefix when not the default) that TVM cannot import.

    Maps each type to the names of the nodes that use it (``<op>#<index>`` when unnamed).
    """
    from tvm.relax.frontend.onnx import onnx_frontend

    model = load_onnx(path_or_model)
    supported = set(onnx_frontend._get_convert_map()) | {"Constant", "If"}
    out: dict[str, list[str]] = {}
    for k, node in enumerate(_walk_nodes(model.graph)):
        if node.op_type not in supported:
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            )
            out.setdefault(key, []).append(node.name or f"{node.op_type}#{k}")
    return out


def _check_supported(model) -> None:
    bad = unsupported_onnx_ops(model)
    if not bad:
        return
    parts = []
    for op, nodes in sorted(bad.items()):
        n = len(nodes)
        parts.append(f"{op} ({n} node{'s' if n > 1 else ''}, e.g. {nodes[0]!r})")
    msg = (
        f"TVM {tvm.__version__}'s ONNX importer does not support {len(bad)} operator type(s) "
        f"used by this model: {', '.join(parts)}."
    )
    if any(op.split(".")[-1].startswith("QLinear") or op in _QOPERATOR for op in bad):
        msg += (
            " This is a quantized model in QOperator format: import it with "
            "autoq.import_quantized(path) -> (mod, qparams, report), which keeps its int8 "
            "weights and qparams, or import the float model and quantize it with autoq."
        )
    raise UnsupportedOpsError(msg, bad)


def _check_not_quantized(model, allow: bool) -> None:
    """A QDQ model imports as float ops between quantize/dequantize (fp32 weights, run-time
    quantize), which autoq cannot quantize again: point to autoq.import_quantized."""
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    if qdq and not allow:
        raise QuantizedModelError(
            f"this ONNX model is already quantized ({len(qdq)} QuantizeLinear/DequantizeLinear "
            "nodes). Import it with autoq.import_quantized(path) -> (mod, qparams, report): "
            "the canonical int8 module with the file's int8 weights and qparams. "
            "from_onnx(..., allow_quantized=True) imports it as TVM does (fp32 ops between "
            "quantize/dequantize)."
        )


def _failing_node(tb):
    """The ONNX node TVM's importer was converting when it raised (from its frame)."""
    node = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_construct_nodes":
            node = tb.tb_frame.f_locals.get("node", node)
        tb = tb.tb_next
    return node


def _tvm_import(model, shapes, optimized: bool):
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx

    try:
        return tvm_from_onnx(
            model, shape_dict=shapes, keep_params_in_input=True, sanitize_input_names=False
        )
    except Exception as e:
        node = _failing_node(sys.exc_info()[2])
        where = (
            f" at node {node.name!r} ({node.op_type}, inputs {list(node.input)})"
            if node is not None
            else ""
        )
        hint = (
            ""
            if optimized
            else "\nThe model was imported as it is (optimize=False); real exports often import "
            "only after ONNX Runtime folds their shape computations: try optimize=True."
        )
        raise FrontendError(
            f"TVM's ONNX importer failed{where}: {type(e).__name__}: {e}{hint}"
        ) from e


def _weight_initializers(model) -> set[str]:
    out = set()
    for node in model.graph.node:
        for idx in _WEIGHT_CONSUMERS.get(node.op_type, ()):
            if idx < len(node.input) and node.input[idx]:
                out.add(node.input[idx])
    return out


def _is_weight_initializer(t, weights: set[str]) -> bool:
    import onnx

    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    size = int(np.prod(t.dims)) if len(t.dims) else 1
    return np.issubdtype(dtype, np.floating) and (size > 1 or t.name in weights)


def _inline_non_weights(model) -> None:
    """Turn initializers that are not weights into ``Constant`` nodes (in place).

    TVM's importer makes every initializer a function parameter under
    ``keep_params_in_input``; for shapes, axes and scalars that hides constants it needs at
    import time (``Expand`` by a parameter shape becomes a dynamic shape).
    """
    import onnx

    weights = _weight_initializers(model)
    inline = [t for t in model.graph.initializer if not _is_weight_initializer(t, weights)]
    if not inline:
        return
    names = {t.name for t in inline}
    keep = [t for t in model.graph.initializer if t.name not in names]
    nodes = [onnx.helper.make_node("Constant", [], [t.name], value=t) for t in inline]
    inputs = [i for i in model.graph.input if i.name not in names]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    rest = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes + rest)


def strip_fusion_prefix(name: str) -> str:
    """An initializer name without the prefixes ONNX Runtime's fusions add
    (``ConvAddFusion_Add_B_conv1.bias`` -> ``conv1.bias``)."""
    while _ORT_FUSION_PREFIX.match(name):
        name = _ORT_FUSION_PREFIX.sub("", name, count=1)
    return name


def _display_names(names: list[str]) -> dict[str, str]:
    """Undo ONNX Runtime's fusion prefixes when the original name is free."""
    taken = set(names)
    out = {}
    for n in names:
        stripped = strip_fusion_prefix(n)
        if stripped != n and stripped not in taken:
            taken.add(stripped)
            out[n] = stripped
        else:
            out[n] = n
    return out


_MINMAX = re.compile(r"^(maximum|minimum)\d*$")


def _raise_clip(mod: tvm.IRModule) -> tvm.IRModule:
    """Turn the importer's lowering of ONNX ``Clip`` back into ``relax.clip``.

    TVM's ONNX importer emits ``Clip(x, lo, hi)`` as ``call_tir(maximum, x, lo)`` then
    ``call_tir(minimum, ., hi)`` behind a NaN guard ``where(isnan(b), -inf/inf, b)`` on each
    bound. With constant scalar bounds that is exactly ``relax.clip(x, lo, hi)``, which the
    quantizer knows (clip commutes with quantization: ReLU6 and friends). Anything else is
    left as it is.
    """
    func = mod["main"]
    if not isinstance(func.body, relax.SeqExpr):
        return mod
    value_of = {}
    users: dict[relax.Var, int] = {}
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b, relax.VarBinding):
                value_of[b.var] = b.value
            for v in relax.analysis.free_vars(b.value):
                users[v] = users.get(v, 0) + 1
    for v in relax.analysis.free_vars(func.body.body):
        users[v] = users.get(v, 0) + 1

    def const_scalar(expr) -> float | None:
        if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.value, tvm.runtime.Tensor):
            arr = expr.value.numpy()
            if arr.size == 1 and np.issubdtype(arr.dtype, np.floating):
                return float(arr.reshape(()))
        return None

    def bound(expr) -> float | None:
        c = const_scalar(expr)
        if c is not None or not isinstance(expr, relax.Var):
            return c
        where = value_of.get(expr)  # where(isnan(b), repl, b)
        if not (isinstance(where, relax.Call) and getattr(where.op, "name", "") == "relax.where"):
            return None
        cond, repl, b = where.args
        isnan = value_of.get(cond) if isinstance(cond, relax.Var) else None
        if not (
            isinstance(isnan, relax.Call)
            and getattr(isnan.op, "name", "") == "relax.isnan"
            and isnan.args[0].same_as(b)
        ):
            return None
        b_val, r_val = const_scalar(b), const_scalar(repl)
        if b_val is None or r_val is None:
            return None
        return r_val if np.isnan(b_val) else b_val

    def minmax(expr):
        """(kind, x, bound) for call_tir(maximum|minimum, (x, constant scalar bound))."""
        if not (isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir"):
            return None
        gv, args = expr.args[0], expr.args[1]
        m = _MINMAX.match(getattr(gv, "name_hint", ""))
        if m is None or not isinstance(args, relax.Tuple) or len(args.fields) != 2:
            return None
        x, b = args.fields
        val = bound(b)
        if val is None or _shape_of_ty(x) != _shape_of_ty(expr):
            return None
        return m.group(1), x, val

    values, drop = {}, set()
    for var, value in value_of.items():
        outer = minmax(value)
        if outer is None or var in drop:
            continue
        kind, x, val = outer
        lo, hi = (val, float("inf")) if kind == "maximum" else (float("-inf"), val)
        inner = minmax(value_of.get(x)) if isinstance(x, relax.Var) else None
        if inner is not None and inner[0] != kind and users.get(x, 0) == 1:
            _, x_in, val_in = inner
            if kind == "minimum":
                lo = val_in
            else:
                hi = val_in
            drop.add(x)
            values.pop(x, None)
            x = x_in
        values[var] = relax.op.clip(x, lo, hi)
    if not values:
        return mod
    out = with_main(mod, rebind(func, values, drop))
    return relax.transform.DeadCodeElimination(["main"])(out)


def _shape_of_ty(expr):
    ty = expr.ty if isinstance(expr, relax.Expr) else None
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return (str(ty.dtype), tuple(str(d) for d in ty.shape.values))
    return None


def _finish_onnx(mod, model, fold_bn: bool):
    """Name, classify and collect the weights of a freshly imported ONNX module."""
    mod, detached = relax.frontend.detach_params(mod)
    func = mod["main"]
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else 0
    values = [v.numpy() for v in detached.get("main", [])]
    param_vars = list(func.params[num_input:])
    if len(values) != len(param_vars):
        raise FrontendError(
            f"internal: {len(param_vars)} weight parameters but {len(values)} values after import"
        )
    # TVM names a parameter after its initializer without a leading "onnx::"
    by_tvm_name: dict[str, str] = {}
    for t in model.graph.initializer:
        by_tvm_name.setdefault(t.name.removeprefix("onnx::"), t.name)
    onnx_names = [by_tvm_name.get(v.name, v.name) for v in param_vars]
    display = _display_names(onnx_names)
    rename = {var: display[name] for var, name in zip(param_vars, onnx_names, strict=True)}
    params = {display[name]: arr for name, arr in zip(onnx_names, values, strict=True)}
    func = rename_params(func, rename)
    func, params = drop_unused_params(func, params)
    mod = with_main(mod, func)
    mod = _raise_clip(mod)
    if fold_bn:
        mod, params = fold_batch_norm(mod, params)
        mod, params = fold_affine(mod, params)
    return mod, params


def from_onnx(
    path_or_model,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    optimize: bool = True,
    fold_bn: bool = True,
    verbose: bool = False,
    allow_quantized: bool = False,
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import an ONNX model as ``(mod, params)``.

    ``path_or_model``: a path, an ``onnx.ModelProto`` (not modified) or serialized bytes.
    ``input_shapes``: ``{input name: shape}`` for inputs with dynamic dimensions (inputs whose
    shapes are static in the file may be omitted). ``optimize``: fold constants with ONNX
    Runtime first (see the module docstring). ``fold_bn``: fold remaining batch norms into
    convolutions. ``verbose``: print the time of each step.

    ``allow_quantized``: an already-quantized (QDQ) model raises
    :class:`QuantizedModelError` pointing to :func:`autoq.import_quantized` unless this is
    True (then it imports as TVM's importer does it: fp32 ops between quantize/dequantize).

    Raises ``ValueError`` for bad or missing ``input_shapes`` (naming the inputs),
    :class:`UnsupportedOpsError` when TVM lacks converters for some operators, and
    :class:`FrontendError` when conversion fails at a node (naming it).
    """
    t0 = time.perf_counter()

    def log(step):
        if verbose:
            print(f"[from_onnx] {step}: {time.perf_counter() - t0:.2f} s")

    model = load_onnx(path_or_model)
    shapes = _resolve_shapes(model, input_shapes)
    _check_supported(model)
    _check_not_quantized(model, allow_quantized)
    _fix_input_shapes(model, shapes)
    if optimize:
        with tempfile.TemporaryDirectory(prefix="autoq_onnx_") as tmp:
            model = _ort_optimize(model, Path(tmp))
        log("onnxruntime basic optimization")
        _check_supported(model)
    _inline_non_weights(model)
    with warnings_quiet():
        mod = _tvm_import(model, shapes, optimize)
    log("tvm import")
    mod, params = _finish_onnx(mod, model, fold_bn)
    log("weights named and folded")
    return mod, params


@contextlib.contextmanager
def warnings_quiet():
    """TVM's importer warns for every renamed input and checker remark; keep errors only."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------------


def _import_torch():
    try:
        import torch
    except ImportError:
        raise ImportError("from_torch needs PyTorch: pip install torch (or autoq[torch])") from None
    return torch


def from_torch(
    module,
    example_inputs,
    *,
    fold_bn: bool = True,
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import a ``torch.nn.Module`` as ``(mod, params)`` via ``torch.export``.

    ``example_inputs``: a tensor, a tuple/list of tensors (positional arguments) or a dict
    (keyword arguments); numpy arrays are accepted. Shapes are taken from them (static).
    The module is exported in eval mode (its training flag is restored afterwards). Weight
    parameters are named by their module path (``layer1.0.conv1.weight``); buffers such as
    batch-norm running statistics become constants; batch norms are folded into the
    preceding convolutions unless ``fold_bn=False``. A single output is returned as a
    tensor, several as a tuple.
    """
    torch = _import_torch()
    from tvm.relax.frontend.torch import from_exported_program

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch takes a torch.nn.Module, got {type(module).__name__}")

    def to_tensor(x):
        if isinstance(x, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(x))
        return x

    if isinstance(example_inputs, Mapping):
        args, kwargs = (), {k: to_tensor(v) for k, v in example_inputs.items()}
    elif isinstance(example_inputs, tuple | list):
        args, kwargs = tuple(to_tensor(x) for x in example_inputs), {}
    else:
        args, kwargs = (to_tensor(example_inputs),), {}

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ep = torch.export.export(module, args, kwargs)
    finally:
        module.train(was_training)
    try:
        with warnings_quiet():
            mod = from_exported_program(
                ep, keep_params_as_input=True, unwrap_unit_return_tuple=True
            )
    except Exception as e:
        raise FrontendError(f"TVM's PyTorch importer failed: {type(e).__name__}: {e}") from e
    mod, _ = relax.frontend.detach_params(mod)
    func = mod["main"]

    kind = torch.export.graph_signature.InputKind
    targets = {
        s.arg.name: s.target for s in ep.graph_signature.input_specs if s.kind == kind.PARAMETER
    }
    state = ep.state_dict
    rename: dict[relax.Var, str] = {}
    params: dict[str, np.ndarray] = {}
    for var in func.params:
        if var.name not in targets:
            continue
        target = targets[var.name]
        arr = state[target].detach().cpu().numpy()
        rename[var] = target
        params[target] = arr
    func = rename_params(func, rename)
    func, params = drop_unused_params(func, params)
    mod = with_main(mod, func)
    if fold_bn:
        mod, params = fold_batch_norm(mod, params)
        mod, params = fold_affine(mod, params)
    return mod, params
