"""ONNX import: :func:`from_onnx` (see :mod:`autoq.frontends` for the decisions)."""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from autoq.frontends.clip import raise_clip
from autoq.frontends.control_flow import apply_constant_inputs, check_no_control_flow, fold_ifs
from autoq.frontends.errors import FrontendError, warnings_quiet
from autoq.frontends.onnx_model import (
    check_not_quantized,
    check_supported,
    fix_input_shapes,
    inline_non_weights,
    load_onnx,
    ort_optimize,
    resolve_input_shapes,
    strip_ort_fusion_prefix,
)
from autoq.frontends.recurrent import rewrite_recurrent
from autoq.frontends.weights import finish_import

__all__ = ["from_onnx"]


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


#: ONNX op -> the name of each weight input position (torch's exporter writes folded weights
#: as anonymous ``onnx::Conv_16`` initializers; the consuming node's scope names the module)
_WEIGHT_INPUTS = {
    "Conv": {1: "weight", 2: "bias"},
    "ConvTranspose": {1: "weight", 2: "bias"},
    "Gemm": {1: "weight", 2: "bias"},
}
_ANONYMOUS = re.compile(r"^onnx::[A-Za-z]+_\d+$")


def module_path(node_name: str) -> str | None:
    """The torch module path in a node name written by torch's ONNX exporter, or None.

    The exporter joins the scopes with ``/`` and ends with the op: a scope that starts with
    the previous one plus ``.`` (a ``Sequential`` child) replaces it, any other is a child.

    >>> module_path("/layer1/layer1.0/downsample/downsample.0/Conv")
    'layer1.0.downsample.0'
    >>> module_path("/conv1/Conv"), module_path("Conv_12"), module_path("/Relu")
    ('conv1', None, None)
    """
    if not node_name.startswith("/"):
        return None
    parts: list[str] = []
    for seg in node_name.split("/")[1:-1]:
        if parts and seg.startswith(parts[-1] + "."):
            parts[-1] = seg
        elif seg:
            parts.append(seg)
    return ".".join(parts) or None


def _scoped_name(name: str, graph) -> str | None:
    """``<module path>.weight|bias`` for an anonymous initializer read by exactly one
    weight input of a scoped node (see :func:`module_path`), else None."""
    if not _ANONYMOUS.match(name):
        return None
    uses = [(n, i) for n in graph.node for i, inp in enumerate(n.input) if inp == name]
    if len(uses) != 1:
        return None
    node, index = uses[0]
    role = _WEIGHT_INPUTS.get(node.op_type, {}).get(index)
    path = module_path(node.name)
    return f"{path}.{role}" if role and path else None


def _display_names(names: list[str], graph) -> dict[str, str]:
    """Undo ONNX Runtime's fusion prefixes and name torch's anonymous folded weights after
    their module (``onnx::Conv_16`` -> ``layer1.0.conv1.weight``) when the name is free."""
    taken = set(names)
    out = {}
    for n in names:
        stripped = strip_ort_fusion_prefix(n)
        better = _scoped_name(stripped, graph) or stripped
        if better != n and better not in taken:
            taken.add(better)
            out[n] = better
        else:
            out[n] = n
    return out


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
    display = _display_names(onnx_names, model.graph)
    rename = {var: display[name] for var, name in zip(param_vars, onnx_names, strict=True)}
    params = {display[name]: arr for name, arr in zip(onnx_names, values, strict=True)}
    return finish_import(mod, func, rename, params, fold_bn, rewrite=raise_clip)


def from_onnx(
    path_or_model,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    optimize: bool = True,
    fold_bn: bool = True,
    verbose: bool = False,
    allow_quantized: bool = False,
    constant_inputs: Mapping[str, object] | None = None,
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
    apply_constant_inputs(model, constant_inputs)
    shapes = resolve_input_shapes(model, input_shapes)
    check_supported(model)
    check_not_quantized(model, allow_quantized)
    fix_input_shapes(model, shapes)
    fold_ifs(model)
    if optimize:
        with tempfile.TemporaryDirectory(prefix="autoq_onnx_") as tmp:
            model = ort_optimize(model, Path(tmp))
            # an inlined branch brings shape arithmetic (and maybe more If) to fold again
            while any(n.op_type == "If" for n in model.graph.node) and fold_ifs(model):
                model = ort_optimize(model, Path(tmp))
        log("onnxruntime basic optimization")
        check_supported(model)
    check_no_control_flow(model)
    if rewrite_recurrent(model):
        log("recurrent layers unrolled")
        if optimize:  # fold what reads only constants (a constant initial state's terms)
            with tempfile.TemporaryDirectory(prefix="autoq_onnx_") as tmp:
                model = ort_optimize(model, Path(tmp))
    inline_non_weights(model)
    with warnings_quiet():
        mod = _tvm_import(model, shapes, optimize)
    log("tvm import")
    mod, params = _finish_onnx(mod, model, fold_bn)
    log("weights named and folded")
    return mod, params
