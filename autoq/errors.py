"""autoq's own exception types: every error about the user's input derives from
:class:`AutoqError` (and from the builtin it refines, so ``except ValueError`` keeps working),
and its message names the slot, layer, file or option at fault and how to fix it.

The command line reports any :class:`AutoqError` as one ``autoq: error: ...`` line with exit
code 2; anything else is an internal error (a bug).
"""

from __future__ import annotations

__all__ = [
    "AutoqError",
    "BuildCheckError",
    "CalibrationError",
    "CalibratorError",
    "DatasetError",
    "ExportError",
    "InputError",
    "LibraryError",
    "OutputError",
    "PlatformError",
    "QParamsError",
    "SmoothQuantSkipped",
]


class AutoqError(Exception):
    """Base of the errors autoq raises about its input (never a bug in autoq)."""


class InputError(AutoqError, ValueError):
    """A value given to autoq (an argument, a file, a model) is not usable."""


class DatasetError(InputError):
    """The calibration data does not fit the model (the message says where and how)."""


class QParamsError(InputError):
    """A qparams document (or one slot of it) is invalid; the message names the slot."""


class CalibrationError(InputError):
    """Calibration cannot give a usable int8 model (the message names the slot/layer)."""


class CalibratorError(InputError, TypeError):
    """A user calibrator (function or object) breaks the calibrator contract; the message
    names the contract and what the calibrator returned."""


class ExportError(InputError):
    """A quantized module holds something the ONNX export cannot write (the message names
    the binding and the op, and what to use instead)."""


class LibraryError(InputError, OSError):
    """A compiled library file is missing, truncated or not written by autoq."""


class OutputError(InputError, OSError):
    """An output folder cannot be written (or holds files autoq did not write)."""


class PlatformError(InputError, OSError):
    """The target asks for something this machine or process cannot run (e.g. AMX tiles the
    operating system refuses); the message names the feature and how to compile without it."""


class BuildCheckError(AutoqError, RuntimeError):
    """The module autoq would return fails TVM's structural checks, so it would not build;
    the message names the function, the binding (layer) and its op. Keep that layer in fp32
    (``Config(fallback=Fallback(ids=[...]))``) and report the model."""


class SmoothQuantSkipped(UserWarning):
    """``Config.smooth_quant`` could not run and the model was quantized without it (the
    message says why, e.g. the calibration samples are read only by a cluster's workers)."""
