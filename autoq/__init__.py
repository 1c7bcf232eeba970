# ruff: noqa: E402  (quiet_startup runs before the slow imports)
"""autoq: post-training auto-quantization for Apache TVM Relax.

``autoq.quantize(mod, params, dataset, config)`` runs the three stages
``simulate -> calibrate -> realize`` and returns an int8 ``IRModule``
(``autoq.Quantizer(config).run(...)`` returns it with the qparams, the fallback decision,
timings and warnings); the stages are exposed for users who need them, and calibration
results are data (:class:`QParams`).
"""

from .interrupts import quiet_startup

quiet_startup()  # the ``autoq`` command: a Ctrl-C while importing prints one line

from . import primitives, qnn  # noqa: F401  (importing qnn registers the qnn.* ops)
from .analysis import Analysis, analyze
from .auto_fallback import FallbackDecision
from .build import compile, default_target, export_library, load_library
from .calibrate import calibrate
from .config import (
    AutoFallback,
    Config,
    Distributed,
    Fallback,
    Override,
    QuantSpec,
    TokenMask,
)
from .errors import AutoqError, DatasetError, InputError, SmoothQuantSkipped
from .frontends import from_onnx, from_torch
from .import_quantized import import_quantized
from .pipeline import Quantizer, QuantizeResult, check_scales, quantize
from .qparams import QParam, QParams, load_qparams
from .realize import realize
from .report import Report
from .simulate import SimResult, simulate
from .threads import set_threads, use_machine_cores
from .tune import tune

use_machine_cores()  # TVM's pools on every physical core (TVM alone takes half on x86)

__version__ = "0.1.0"

__all__ = [
    "Analysis",
    "AutoFallback",
    "AutoqError",
    "Config",
    "DatasetError",
    "Distributed",
    "Fallback",
    "FallbackDecision",
    "InputError",
    "Override",
    "QParam",
    "QParams",
    "QuantSpec",
    "QuantizeResult",
    "Quantizer",
    "Report",
    "SimResult",
    "SmoothQuantSkipped",
    "TokenMask",
    "analyze",
    "calibrate",
    "check_scales",
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
    "set_threads",
    "simulate",
    "tune",
]
