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
  preceding convolution by :func:`autoq.ir.prepare.fold_batch_norm`, and batch norms written as
  per-channel ``Sub``/``Mul``/``Add`` chains (Caffe-origin models such as Open-NSFW) by
  :func:`autoq.ir.prepare.fold_affine` (``fold_bn=False`` keeps both).
* **Errors.** Operators TVM's importer cannot convert are listed by type, with counts and a
  node name each, before any work; QOperator-format quantized models (``QLinearConv`` ...) get
  a hint. When a supported operator fails to convert, the error names the ONNX node.
* **torch is optional** and imported lazily by :func:`from_torch` (extra ``autoq[torch]``).

Modules: :mod:`.errors` (the exceptions both importers raise), :mod:`.onnx_model` (the ONNX
file before TVM sees it: loading, static shapes, ONNX Runtime's folding, operator support,
which initializers are weights), :mod:`.control_flow` (``constant_inputs``, ``If`` folding,
the error for control flow left), :mod:`.recurrent` (ONNX LSTM / GRU / RNN unrolled into
standard ops), :mod:`.onnx` (:func:`from_onnx`), :mod:`.clip` (ONNX
``Clip`` back to ``relax.clip``), :mod:`.torch` (:func:`from_torch`) and :mod:`.weights` (the
naming and folding every importer ends with).
"""

from __future__ import annotations

from autoq.frontends.errors import FrontendError, QuantizedModelError, UnsupportedOpsError
from autoq.frontends.onnx import from_onnx
from autoq.frontends.onnx_model import (
    ORT_FUSION_PREFIX,
    load_onnx,
    onnx_input_shapes,
    strip_ort_fusion_prefix,
    unsupported_onnx_ops,
)
from autoq.frontends.torch import from_torch

__all__ = [
    "ORT_FUSION_PREFIX",
    "FrontendError",
    "QuantizedModelError",
    "UnsupportedOpsError",
    "from_onnx",
    "from_torch",
    "load_onnx",
    "onnx_input_shapes",
    "strip_ort_fusion_prefix",
    "unsupported_onnx_ops",
]
