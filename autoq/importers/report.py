"""What :func:`autoq.import_quantized` found and did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoq.config import Config

__all__ = ["ImportReport"]


@dataclass
class ImportReport:
    """What :func:`import_quantized` found and did.

    ``format``: "QDQ" or "QOperator". ``rewritten``: QOperator op type ->
    nodes rewritten into QDQ form. ``layers``: layer id -> pattern, the integer layers.
    ``fallback``: layer id -> why the layer runs in fp32 (dequantize -> fp32 op -> quantize).
    ``float_ops``: ONNX nodes (``name (OpType)``) next to quantized tensors that run in fp32
    in the imported module, with their Relax op. ``notes``: anything else worth knowing
    (biases rescaled, biases quantized here because the file kept them in float).
    ``timings``: seconds per step. ``float_mod``, ``params``, ``config``: what was realized
    (a :class:`autoq.importers.assemble.FloatModel`: the float module's matches and
    the file's rounding points), its weights, and the config used:
    ``realize(float_mod, params, qparams, config)`` rebuilds the module before its integer
    inputs/outputs are restored.
    """

    format: str = ""
    rewritten: dict[str, int] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)
    float_ops: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: quantized tensor (ONNX name / FX node name) -> its position in the outputs of
    #: ``realize_file(float_mod, ...)``, which still returns every quantized tensor
    #: (dequantized): per-tensor comparisons with the source runtime
    tensors: dict[str, int] = field(default_factory=dict)
    activation_tensors: int = 0
    weight_tensors: int = 0
    float_mod: Any = field(default=None, repr=False)
    params: dict | None = field(default=None, repr=False)
    config: Config | None = field(default=None, repr=False)

    def summary(self) -> str:
        lines = [
            f"format {self.format}; {len(self.layers)} integer layers, {len(self.fallback)} "
            f"fallback, {self.activation_tensors} quantized activations, "
            f"{self.weight_tensors} integer weights/biases"
        ]
        if self.rewritten:
            lines.append(
                "rewritten to QDQ: " + ", ".join(f"{k} x{v}" for k, v in self.rewritten.items())
            )
        for k, v in self.fallback.items():
            lines.append(f"fallback {k}: {v}")
        for k, v in self.float_ops.items():
            lines.append(f"fp32 op {k}: {v}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
