"""Compile and export realized modules (the last step a user takes)."""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax

from .errors import LibraryError
from .library_file import check_library, write_stamp

__all__ = ["compile", "default_target", "export_library", "load_library"]


def default_target() -> tvm.target.Target:
    """LLVM for this machine's CPU (a bare {"kind": "llvm"} is generic x86-64 without AVX2,
    and "mcpu": "native" is silently ignored, see docs/platform notes)."""
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def compile(mod: tvm.IRModule, target=None, fuse: bool = True):
    """``tvm.compile`` with the default Relax pipeline for ``target`` (fusion on by default)."""
    target = target or default_target()
    if isinstance(target, dict):
        target = tvm.target.Target(target)
    pipeline = relax.get_default_pipeline(target) if fuse else None
    if pipeline is None:
        return tvm.compile(mod, target)
    return tvm.compile(mod, target, relax_pipeline=pipeline)


def export_library(mod: tvm.IRModule, path: str | Path, target=None) -> Path:
    """Compile ``mod`` and write a shared library loadable with :func:`load_library`, with
    its stamp ``<path>.autoq.json`` (size and SHA-256, see :mod:`autoq.library_file`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compile(mod, target).export_library(str(path))
    write_stamp(path)
    return path


def load_library(path: str | Path, device=None) -> relax.VirtualMachine:
    """A VirtualMachine over a library written by :func:`export_library`; a missing,
    truncated, modified or foreign file is a :class:`autoq.errors.LibraryError` naming it."""
    path = check_library(path)
    try:
        lib = tvm.runtime.load_module(str(path))
        return relax.VirtualMachine(lib, device or tvm.cpu())
    except Exception as e:  # dlopen errors, a library without a Relax VM executable
        raise LibraryError(
            f"{str(path)!r} cannot be loaded as an autoq/TVM model library: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from None
