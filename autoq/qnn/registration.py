"""Registering a ``qnn.*`` op with TVM from Python, and building calls of it.

:func:`register` is ``RegisterOp`` + ``FInferType`` + ``FPurity`` + the legalization; it is
idempotent within a process. :data:`OPS` lists every registered op with its description.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir import _ffi_api as _ir_ffi
from tvm.relax.transform.legalize_ops.common import register_legalize

__all__ = ["OPS", "make_call", "register"]

OPS: dict[str, str] = {}


def register(builder: Callable, infer: Callable, legalize: Callable) -> None:
    """Register ``qnn.<builder's name>``: ``infer(op_name, call) -> TensorType`` is its type
    inference and ``legalize(bb, call)`` lowers it to Relax ops or TE; the builder's first
    docstring paragraph is the op's description."""
    full = "qnn." + builder.__name__
    doc = " ".join((builder.__doc__ or "").strip().split("\n\n")[0].split())
    try:
        op = tvm.ir.Op.get(full)
    except Exception:
        _ir_ffi.RegisterOp(full, doc)
        op = tvm.ir.Op.get(full)
    if op.get_attr("FInferType") is None:  # not yet registered in this process

        def f_infer(call, ctx, _infer=infer, _name=full):
            return _infer(_name, call)

        op.set_attr("FInferType", f_infer)
        op.set_attr("FPurity", True)
        register_legalize(full, legalize)
    OPS[full] = doc


def make_call(name: str, args, attrs: dict) -> relax.Call:
    """A call of the registered op ``name`` with its attributes in a ``DictAttrs``."""
    return tvm.ir.Call(tvm.ir.Op.get(name), [a for a in args], attrs)
