"""autoq: post-training auto-quantization for Apache TVM Relax.

``autoq.quantize(mod, params, dataset)`` runs the three stages ``simulate -> calibrate ->
realize`` with the recipe the model's structure calls for and returns an int8 ``IRModule``
(``autoq.Quantizer(config).run(...)`` returns it with the qparams, the recipe, the fallback
decision, timings and warnings); the stages are exposed for users who need them, and
calibration results are data (:class:`QParams`).

Importing autoq is cheap and changes nothing in the process: each name below is imported
(with TVM) when first used.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

#: public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "Analysis": "autoq.fallback.analysis",
    "analyze": "autoq.fallback.analysis",
    "FallbackDecision": "autoq.fallback.auto_fallback",
    "compile": "autoq.build",
    "default_target": "autoq.build",
    "export_library": "autoq.build",
    "export_onnx": "autoq.export",
    "load_library": "autoq.build",
    "calibrate": "autoq.calibration",
    "AutoFallback": "autoq.config",
    "BiasCorrection": "autoq.config",
    "Config": "autoq.config",
    "Distributed": "autoq.config",
    "Fallback": "autoq.config",
    "Override": "autoq.config",
    "QuantSpec": "autoq.config",
    "Resources": "autoq.config",
    "AutoqError": "autoq.errors",
    "DatasetError": "autoq.errors",
    "ExportError": "autoq.errors",
    "InputError": "autoq.errors",
    "SmoothQuantSkipped": "autoq.errors",
    "from_onnx": "autoq.frontends",
    "from_torch": "autoq.frontends",
    "import_quantized": "autoq.importers",
    "Quantizer": "autoq.pipeline",
    "QuantizeResult": "autoq.pipeline",
    "check_scales": "autoq.pipeline",
    "quantize": "autoq.pipeline",
    "QParam": "autoq.qparams",
    "QParams": "autoq.qparams",
    "load_qparams": "autoq.qparams",
    "realize": "autoq.realization",
    "Report": "autoq.fallback.report",
    "load": "autoq.session",
    "Session": "autoq.session",
    "SimResult": "autoq.simulation",
    "simulate": "autoq.simulation",
    "set_threads": "autoq.threads",
    "tune": "autoq.tuning",
}
#: modules whose names need no TVM (configuration, errors)
_WITHOUT_TVM = ("autoq.config", "autoq.errors")
#: submodules reachable as attributes (``autoq.recipes.RECIPES``)
_SUBMODULES = ("calibrators", "dataset", "patterns", "primitives", "qnn", "recipes")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        if _EXPORTS[name] not in _WITHOUT_TVM:
            importlib.import_module("autoq.qnn")  # registers the qnn.* ops before any use
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"autoq.{name}")
    raise AttributeError(f"module 'autoq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES, "__version__"])
