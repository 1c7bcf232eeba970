"""``export_onnx``: the int8 result as a standard ONNX QDQ model (docs/export.md).

The realized module is written op by op (:mod:`autoq.export.writer` walks ``main``; one rule
per op in :mod:`autoq.export.qnn_rules` and :mod:`autoq.export.relax_rules`): activations as
``QuantizeLinear`` / ``DequantizeLinear`` with autoq's scales and zero points, weights as int8
initializers with per-channel axes, biases as int32 initializers, lookup-table activations as
an exact ``Gather``; ONNX Runtime and OpenVINO fuse the ``DequantizeLinear -> Conv ->
QuantizeLinear`` groups into their int8 kernels.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from autoq.errors import ExportError
from autoq.json_document import write_atomic

from .graph import Float, Int
from .qnn_rules import RULES as QNN_RULES
from .relax_rules import RULES as RELAX_RULES
from .writer import Writer, value_info

__all__ = ["OPSET", "RULES", "export_onnx", "to_onnx"]

#: the ONNX opset of the exported models (21: int16 QuantizeLinear / DequantizeLinear)
OPSET = 21
#: op name -> rule(writer, call, var): every op the export writes
RULES = {**QNN_RULES, **RELAX_RULES}


def to_onnx(result, output_names=None) -> onnx.ModelProto:
    """The ONNX QDQ model of ``result`` (a :class:`autoq.QuantizeResult`, or the int8
    ``IRModule`` of ``autoq.quantize`` / ``autoq.import_quantized``). Inputs keep the names
    of ``main``'s parameters (the ONNX frontend keeps the model's names); outputs are
    ``output_names`` (default ``output0``, ``output1``, ...)."""
    module = getattr(result, "module", result)
    func = module["main"]
    inputs = [p.name for p in func.params]
    writer = Writer(func, RULES, module)
    ret = func.body.body.ty
    fields = list(ret.fields) if hasattr(ret, "fields") else [ret]
    names = list(output_names or [f"output{i}" for i in range(len(fields))])
    if len(names) != len(fields):
        raise ExportError(
            f"ONNX export: {len(names)} output names given for a model with {len(fields)} "
            "outputs; give one name per output"
        )
    for name in names:
        writer.g.reserve(name)
    values = writer.run(inputs)
    for value, name in zip(values, names, strict=True):
        if not isinstance(value, Int | Float):
            raise ExportError(
                f"ONNX export: output '{name}' is an int32 accumulator or a tuple, not a "
                "tensor of the model's output type"
            )
        source = writer.unshifted(value) if isinstance(value, Int) else value.name
        writer.g.output(source, name)
    model = writer.g.model(
        [value_info(n, p.ty) for n, p in zip(inputs, func.params, strict=True)],
        [value_info(n, f) for n, f in zip(names, fields, strict=True)],
        OPSET,
    )
    onnx.checker.check_model(model)
    return model


def export_onnx(result, path, output_names=None) -> Path:
    """Write the ONNX QDQ model of ``result`` (see :func:`to_onnx`) to ``path``, atomically
    (a temporary file renamed over the target once complete). Returns the path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ExportError(f"ONNX export: folder '{path.parent}' does not exist; create it first")
    return write_atomic(path, to_onnx(result, output_names).SerializeToString())
