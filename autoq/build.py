"""Compile and export realized modules (the last step a user takes)."""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax

__all__ = ["compile", "default_target", "export_library", "load_library"]


def default_target() -> tvm.target.Target:
    """LLVM for this machine's CPU (a bare {"kind": "llvm"} is generic x86-64 without AVX2,
    and "mcpu": "native" is silently ignored, see docs/platform notes)."""
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def compile(mod: tvm.IRModule, target=None, fuse: bool = True, database=None):
    """``tvm.compile`` with the default Relax pipeline for ``target`` (fusion on by default).

    ``database``: a tuning database folder written by :func:`autoq.tune` (its kernels get
    their tuned schedules; the others compile as without it)."""
    target = target or default_target()
    if isinstance(target, dict):
        target = tvm.target.Target(target)
    if database is not None:
        from .tuning_database import pipeline_with_database

        return tvm.compile(mod, target, relax_pipeline=pipeline_with_database(target, database))
    pipeline = relax.get_default_pipeline(target) if fuse else None
    if pipeline is None:
        return tvm.compile(mod, target)
    return tvm.compile(mod, target, relax_pipeline=pipeline)


def export_library(mod: tvm.IRModule, path: str | Path, target=None, database=None) -> Path:
    """Compile ``mod`` (with the tuning ``database`` folder, if given) and write a shared
    library loadable with :func:`load_library`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compile(mod, target, database=database).export_library(str(path))
    return path


def load_library(path: str | Path, device=None) -> relax.VirtualMachine:
    """A VirtualMachine over a library written by :func:`export_library`."""
    lib = tvm.runtime.load_module(str(path))
    return relax.VirtualMachine(lib, device or tvm.cpu())
