"""Import models that are already quantized (ONNX, PyTorch PT2E, TFLite) in autoq's
canonical integer form.

``import_quantized(model) -> (mod, qparams, report)`` reads a QDQ model
(QuantizeLinear/DequantizeLinear around the ops) or a QOperator model (QLinearConv,
QLinearMatMul, ConvInteger, MatMulInteger and ONNX Runtime's com.microsoft QGemm,
QLinearAdd, QLinearMul, QLinearConcat, QLinearGlobalAveragePool, QLinearAveragePool,
QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax, QLinearReduceMean) and returns what
:func:`autoq.quantize` returns for a float model: the int8 module (``qnn.quantize ->
qnn.conv2d/dense/matmul -> add(int32 bias) -> qnn.requantize -> ...``), with the file's
integer weights and biases as constants (never dequantized and requantized) and the file's
scales and zero points, plus those qparams as a :class:`QParams` (the same data a
calibration produces: per-layer reports, fallback and re-export work on it).

PyTorch models quantized with torchao's PT2E flow enter at stage 2 through :mod:`.pt2e`
(``quantized_decomposed`` ops -> the same split, the float FX graph imported with
:func:`autoq.frontends.from_torch`); full-integer ``.tflite`` files enter at stage 1
through :mod:`.tflite` (TFLite ops -> ONNX QDQ, ``rounding="tflite"`` by default).

One module per stage, in the order they run:

1. :mod:`.qoperator`: QOperator -> QDQ, one rule per op type (``TABLE``).
2. :mod:`.file_qparams`: QDQ -> float graph + the file's qparams and integer
   weights/biases (:func:`split_qdq`).
3. :mod:`.tensors`: the float graph is imported with :func:`autoq.frontends.from_onnx`;
   which Relax variable holds which quantized ONNX tensor and integer initializer.
4. :mod:`.slots`: the float module is matched **once** (:func:`autoq.ir.matching.match`);
   every match whose activations (and, for elementwise ops, output) the file quantizes and
   whose weight it stores as integers is quantized with the file's qparams, the others go to
   ``Fallback(ids=...)`` with the reason, decided in one pass over the matches. Where a
   quantized tensor also feeds an op that runs in float (a fallback layer, softmax), the
   file's rounding is kept there by a ``qnn.quantize -> qnn.dequantize`` pair
   (``realize(..., rounding_points=...)``).
5. :mod:`.assemble`: realize of those same matches with the integer weights/biases in
   ``QParams.values``, then the extra outputs dropped and integer inputs/outputs restored.

Rounding: the ONNX reference for QLinearConv/QLinearMatMul rounds ``acc * (sx*sw/sy)``
(float64 in onnx's reference, float32 in ONNX Runtime); our default ``rounding="float"``
computes ``round(float32(float32(acc) * float32(sx*sw)) / sy)``. The two can differ only
within float32 rounding of a tie (see tests/test_import_quantized.py for what was measured).

Not supported (a clear error or a fallback, never a silent change): runtime (non-constant)
scales or zero points (DynamicQuantizeLinear), blocked quantization, per-axis activation
quantization, a tensor quantized twice with different qparams, QAttention and the other
contrib ops not listed above, QGemm with ``alpha != 1``, ConvInteger/MatMulInteger whose
input was quantized with a scale other than 1.
"""

from __future__ import annotations

import os
import time

import tvm

from autoq.config import Config
from autoq.frontends import from_onnx, from_torch
from autoq.importers.assemble import FloatModel, finish, realize_file
from autoq.importers.file_qparams import SplitResult, split_qdq
from autoq.importers.onnx_graph import QuantizedImportError, is_quantized_onnx, load
from autoq.importers.pt2e import is_torch_model, split_pt2e
from autoq.importers.qoperator import qoperator_to_qdq
from autoq.importers.report import ImportReport
from autoq.importers.slots import fallback_reasons, fill, float_ops, merge_fallback, rounding_points
from autoq.importers.tensors import FileView, Tensors, bind_params, float_module
from autoq.importers.tflite import is_tflite, tflite_to_qdq
from autoq.ir.matching import match
from autoq.qparams import QParams
from autoq.simulation import SimResult, simulate

__all__ = [
    "ImportReport",
    "QuantizedImportError",
    "import_quantized",
    "is_quantized_onnx",
    "qoperator_to_qdq",
    "realize_file",
    "split_pt2e",
    "split_qdq",
    "tflite_to_qdq",
]


def _parse(source, report: ImportReport) -> SplitResult:
    """Stages 1-2: the float graph and the file's quantization."""
    model, counts = qoperator_to_qdq(load(source))
    report.rewritten = counts
    report.format = "QOperator" if counts else "QDQ"
    split = split_qdq(model)
    if not split.activations and not split.consts:
        raise QuantizedImportError(
            "the model holds no quantized tensors; use autoq.frontends.from_onnx and autoq.quantize"
        )
    report.activation_tensors = len(split.activations)
    report.weight_tensors = len(split.consts)
    return split


def _layers(
    mod: tvm.IRModule, params: dict, names: list, split: SplitResult, config: Config, report
) -> tuple[FloatModel, FileView, SimResult, Config]:
    """Stage 4: match once, decide the fallback in one pass, find the rounding points."""
    matched = match(mod, params, config)  # the only pattern matching of this import
    view = FileView(Tensors(matched.graph, names, split), bind_params(split, params))
    sim = simulate(matched, None, config, exits=False)
    report.fallback = fallback_reasons(view, sim)
    cfg = merge_fallback(config, report.fallback)
    if report.fallback:
        sim = simulate(
            matched, None, cfg, exits=False
        )  # the same matches, filtered: slots without them
    report.layers = {m.layer: m.pattern.name for m in sim.matches}
    report.float_ops = float_ops(view, sim)
    return FloatModel(matched, rounding_points(view, sim.matches)), view, sim, cfg


def _qparams(view: FileView, sim: SimResult, report: ImportReport, model, source) -> QParams:
    plan = fill(view, sim)
    report.notes += plan.notes
    meta = {"source": source, "format": report.format, "fallback": dict(report.fallback)}
    if isinstance(model, str | os.PathLike):
        meta["file"] = str(model)
    return QParams(plan.qparams, dict(sim.slots), meta, plan.values)


def _from_onnx(source, input_shapes, optimize: bool, report: ImportReport):
    """Stages 1-3 for ONNX: the split, the float module and its quantized tensors."""
    split = _parse(source, report)
    mod, params = from_onnx(split.model, input_shapes, optimize=optimize, fold_bn=False)
    return split, mod, params


def _from_torch(model, example_inputs, report: ImportReport):
    """Stages 1-3 for a PT2E-converted torch model (:mod:`.pt2e`)."""
    fg, example_inputs = split_pt2e(model, example_inputs)
    report.format = "PT2E"
    report.notes += fg.notes
    report.activation_tensors = len(fg.split.activations)
    report.weight_tensors = len(fg.split.consts)
    if not fg.split.activations:
        raise QuantizedImportError(
            "the torch model holds no quantized tensors; use autoq.from_torch and autoq.quantize"
        )
    mod, params = from_torch(fg.module, example_inputs, fold_bn=False)
    return fg.split, mod, params


def import_quantized(
    model,
    config: Config | None = None,
    input_shapes: dict | None = None,
    *,
    example_inputs=None,
    optimize: bool = True,
) -> tuple[tvm.IRModule, QParams, ImportReport]:
    """Import a quantized model as autoq's canonical int8 module.

    ``model``: an ONNX model (QDQ or QOperator: a path, an ``onnx.ModelProto``, not modified,
    or bytes), or a PyTorch model quantized with torchao's PT2E flow (the ``convert_pt2e``
    ``GraphModule`` or a ``torch.export.ExportedProgram`` of it; ``example_inputs`` gives the
    shapes, taken from the ExportedProgram when omitted).
    ``config``: patterns, rounding mode (default ``float``) and extra fallback rules; the
    quantization specs and calibrators are not used (the file fixes the qparams).
    ``input_shapes``/``optimize``: as for :func:`autoq.frontends.from_onnx` (the float graph
    is imported with it, batch norms are never folded: the file's weights are final).

    Returns ``(mod, qparams, report)``: the int8 module (``main`` takes the model's inputs
    with their dtypes in the file: an integer input stays integer), the file's qparams as a
    :class:`QParams` (``qparams.values`` holds the integer weights and biases), and an
    :class:`ImportReport`. ``realize(float_mod, params, qparams, config)`` on the
    ``float_mod`` kept in ``report`` reproduces ``mod`` before its integer inputs/outputs
    are restored.
    """
    t0 = time.perf_counter()
    report = ImportReport()
    if is_torch_model(model):
        config = config or Config(recipe="cnn")
        split, mod, params = _from_torch(model, example_inputs, report)
        source = "pt2e"
    elif is_tflite(model):
        # TFLite's own requantization: gemmlowp's doubling multiply + rounding shift
        config = config or Config(recipe="cnn", rounding="tflite")
        split, mod, params = _from_onnx(tflite_to_qdq(model), input_shapes, optimize, report)
        report.format, source = "TFLite", "tflite"
    else:
        config = config or Config(recipe="cnn")
        split, mod, params = _from_onnx(model, input_shapes, optimize, report)
        source = "onnx"
    mod, names = float_module(mod, split)
    report.tensors = {name: pos for pos, name in names}
    report.timings["parse_import_s"] = time.perf_counter() - t0

    t2 = time.perf_counter()
    fm, view, sim, cfg = _layers(mod, params, names, split, config, report)
    qparams = _qparams(view, sim, report, model, source)
    report.timings["slots_s"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    out = finish(realize_file(fm, qparams, cfg), split, cfg.rounding)
    report.timings["realize_s"] = time.perf_counter() - t3
    report.timings["total_s"] = time.perf_counter() - t0
    report.float_mod, report.params, report.config = fm, params, cfg
    return out, qparams, report
