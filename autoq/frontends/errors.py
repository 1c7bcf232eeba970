"""The exceptions of the model importers, and quieting TVM's importer warnings."""

from __future__ import annotations

import contextlib

from autoq.errors import AutoqError

__all__ = [
    "FrontendError",
    "ModelFileError",
    "QuantizedModelError",
    "UnsupportedOpsError",
    "warnings_quiet",
]


class FrontendError(AutoqError, RuntimeError):
    """A model could not be imported; the message says what blocked it and what to do."""


class ModelFileError(FrontendError, FileNotFoundError):
    """The model file (or a file it names, such as its external data) does not exist."""


class QuantizedModelError(FrontendError):
    """The ONNX model is already quantized (QuantizeLinear/DequantizeLinear nodes): use
    :func:`autoq.import_quantized` (or ``from_onnx(..., allow_quantized=True)``)."""


class UnsupportedOpsError(FrontendError, NotImplementedError):
    """The model uses operators that TVM's importer cannot convert (``.ops``: type -> nodes)."""

    def __init__(self, message: str, ops: dict[str, list[str]]):
        super().__init__(message)
        self.ops = ops


@contextlib.contextmanager
def warnings_quiet():
    """TVM's importer warns for every renamed input and checker remark; keep errors only."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
