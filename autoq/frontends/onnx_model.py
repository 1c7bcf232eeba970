"""The ONNX model before TVM sees it: loading, static input shapes, ONNX Runtime's constant
folding, the operators TVM cannot import, and which initializers are weights (see
:mod:`autoq.frontends` for the decisions)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tvm

from autoq.frontends.control_flow import CONTROL_FLOW_OPS
from autoq.frontends.errors import (
    FrontendError,
    ModelFileError,
    QuantizedModelError,
    UnsupportedOpsError,
)
from autoq.frontends.recurrent import RECURRENT_OPS

__all__ = [
    "EXTERNAL_DATA_BYTES",
    "ORT_FUSION_PREFIX",
    "check_not_quantized",
    "check_supported",
    "fix_input_shapes",
    "inline_non_weights",
    "load_onnx",
    "onnx_input_shapes",
    "ort_optimize",
    "resolve_input_shapes",
    "strip_ort_fusion_prefix",
    "unsupported_onnx_ops",
]

#: Initializers renamed by ONNX Runtime's fusions carry the original name after one of these.
ORT_FUSION_PREFIX = re.compile(
    r"^(?:ConvBnFusion_(?:W|BN_B)_|ConvMulFusion_(?:W|Mul_B)_|ConvAddFusion_(?:Add_B|B)_"
    r"|MatMulBnFusion_Gemm(?:B|Bias)_)"
)
_QOPERATOR = ("ConvInteger", "MatMulInteger", "QGemm")
_WEIGHT_CONSUMERS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1,)}
#: models whose initializers exceed this are written with external data for ONNX Runtime
EXTERNAL_DATA_BYTES = 1 << 30


def strip_ort_fusion_prefix(name: str) -> str:
    """An initializer name without the prefixes ONNX Runtime's fusions add
    (``ConvBnFusion_W_conv1.weight`` -> ``conv1.weight``)."""
    while ORT_FUSION_PREFIX.match(name):
        name = ORT_FUSION_PREFIX.sub("", name, count=1)
    return name


def _load_file(path: Path):
    """``onnx.load`` with every way a file can be unusable named: missing, empty, not ONNX
    (truncated or another format), external data missing."""
    import onnx

    if not path.is_file():
        raise ModelFileError(f"no ONNX file at {str(path)!r}")
    if path.stat().st_size == 0:
        raise FrontendError(f"{str(path)!r} is empty (0 bytes): not an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise FrontendError(
            f"{str(path)!r} is not an ONNX model (truncated, or another format): "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from None
    if not model.HasField("graph") or not len(model.graph.node):
        raise FrontendError(f"{str(path)!r} holds no ONNX graph: not an ONNX model")
    _load_external(model, path)
    return model


def _load_external(model, path: Path) -> None:
    """Read the external-data files the model names (next to it); a missing or short one
    is an error naming it and the tensor."""
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    for t in model.graph.initializer:
        if not uses_external_data(t):
            continue
        info = {e.key: e.value for e in t.external_data}
        data = path.parent / info.get("location", "")
        if not data.is_file():
            raise ModelFileError(
                f"{str(path)!r}: the external data file {str(data)!r} (tensor {t.name!r}) is "
                "missing: keep it next to the model, under the name the model gives it"
            )
        need = int(info.get("offset", 0)) + int(info.get("length", 0))
        if data.stat().st_size < need:
            raise FrontendError(
                f"{str(path)!r}: the external data file {str(data)!r} is shorter than tensor "
                f"{t.name!r} needs ({data.stat().st_size} < {need} bytes): truncated"
            )
    load_external_data_for_model(model, str(path.parent))


def load_onnx(path_or_model, caller: str = "from_onnx"):
    """An ``onnx.ModelProto`` from a path, serialized bytes or a model (copied: the caller's
    model is never modified); ``caller`` names the function in the error for other types."""
    import onnx

    if isinstance(path_or_model, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(path_or_model)  # never modify the caller's model
        return model
    if isinstance(path_or_model, bytes | bytearray):
        return onnx.load_from_string(bytes(path_or_model))
    if isinstance(path_or_model, str | os.PathLike):
        return _load_file(Path(path_or_model))
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


def resolve_input_shapes(model, input_shapes) -> dict[str, tuple[int, ...]]:
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


def fix_input_shapes(model, shapes: dict[str, tuple[int, ...]]) -> None:
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


def ort_optimize(model, workdir: Path):
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
    external = init_bytes > EXTERNAL_DATA_BYTES
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
    """Operator types (with ``domain.`` prefix when not the default) that TVM cannot import
    and autoq does not rewrite (recurrent layers) or reject itself (control flow).

    Maps each type to the names of the nodes that use it (``<op>#<index>`` when unnamed).
    """
    from tvm.relax.frontend.onnx import onnx_frontend

    model = load_onnx(path_or_model)
    supported = set(onnx_frontend._get_convert_map()) | {"Constant"}
    supported |= set(CONTROL_FLOW_OPS) | set(RECURRENT_OPS)
    out: dict[str, list[str]] = {}
    for k, node in enumerate(_walk_nodes(model.graph)):
        if node.op_type not in supported:
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
            )
            out.setdefault(key, []).append(node.name or f"{node.op_type}#{k}")
    return out


def check_supported(model) -> None:
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


def check_not_quantized(model, allow: bool) -> None:
    """A QDQ model imports as float ops between quantize/dequantize (fp32 weights, run-time
    quantize), which autoq cannot quantize again: point to autoq.importers."""
    qdq = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    if qdq and not allow:
        raise QuantizedModelError(
            f"this ONNX model is already quantized ({len(qdq)} QuantizeLinear/DequantizeLinear "
            "nodes). Import it with autoq.import_quantized(path) -> (mod, qparams, report): "
            "the canonical int8 module with the file's int8 weights and qparams. "
            "from_onnx(..., allow_quantized=True) imports it as TVM does (fp32 ops between "
            "quantize/dequantize)."
        )


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


def inline_non_weights(model) -> None:
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
