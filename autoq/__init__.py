"""autoq: post-training auto-quantization for Apache TVM Relax.

``autoq.quantize(mod, params, dataset, config)`` runs the three stages
``simulate -> calibrate -> realize`` and returns an int8 ``IRModule``
(``autoq.Quantizer(config).run(...)`` returns it with the qparams, the fallback decision,
timings and warnings); the stages are exposed for users who need them, and calibration
results are data (:class:`QParams`).
"""

from . import primitives, qnn  # noqa: F401  (importing qnn registers the qnn.* ops)
from .analysis import Analysis, analyze
from .auto_fallback import FallbackDecision
from .build import compile, default_target, export_library, load_library
from .calibrate import calibrate
from .config import AutoFallback, Config, Fallback, Override, QuantSpec
from .frontends import from_onnx, from_torch
from .import_quantized import import_quantized
from .pipeline import Quantizer, QuantizeResult, quantize
from .qparams import QParam, QParams, load_qparams
from .realize import realize
from .report import Report
from .simulate import SimResult, simulate
from .tune import tune

__version__ = "0.1.0"

__all__ = [
    "Analysis",
    "AutoFallback",
    "Config",
    "Fallback",
    "FallbackDecision",
    "Override",
    "QParam",
    "QParams",
    "QuantSpec",
    "QuantizeResult",
    "Quantizer",
    "Report",
    "SimResult",
    "analyze",
    "calibrate",
    "compile",
    "default_target",
    "export_library",
    "from_onnx",
    "from_torch",
    "import_quantized",
    "load_library",
    "load_qparams",
    "quantize",
    "realize",
    "simulate",
    "tune",
]
