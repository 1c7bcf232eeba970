"""Compile and export realized modules (the last step a user takes)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import tvm
from tvm import relax

from autoq.cpu.amx import request_amx, require_amx
from autoq.cpu.injective import ScheduleFused
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.errors import LibraryError
from autoq.files import pid_dir, remove_dead_dirs, temp_folder
from autoq.ir.compile_cache import cached_library
from autoq.ir.cpu_pipeline import drop_unused_kernels
from autoq.ir.float_ops import rewrite_float_ops
from autoq.ir.library_file import check_library, stamp_path, write_stamp
from autoq.ir.target import default_target
from autoq.ir.toolkit import weight_bytes
from autoq.threads import use_machine_cores

__all__ = [
    "cached_compile",
    "compile",
    "default_target",
    "export_library",
    "load_library",
    "main_signature",
    "weight_bytes",
]

#: free space an export needs besides twice the weights (object file and library)
_SPARE_BYTES = 16 << 20


def compile(
    mod: tvm.IRModule,
    target=None,
    fuse: bool = True,
    cpu_kernels: bool = True,
    database=None,
    blocked_layout: bool | None = None,
    residual_epilogue: bool | None = None,
):
    """``tvm.compile`` with the default Relax pipeline for ``target`` (fusion on by default).

    ``cpu_kernels``: on x86 LLVM targets with AVX-512 VNNI or AVX2, int8 conv2d/dense/matmul
    with constant weights run on autoq's packed, tensorized kernels (:mod:`autoq.cpu`);
    False keeps the generic lowering of the ``qnn.*`` ops (same results, bit for bit).
    Targets with ``amx-int8`` run dense/matmul on AMX tiles; compiling for one in a process
    that Linux refuses the tile state is a :class:`autoq.errors.PlatformError`.
    ``database``: a tuning database folder written by :func:`autoq.tuning` with the same
    ``cpu_kernels`` (its kernels get their tuned schedules; the others compile as without it).
    ``blocked_layout`` (with ``cpu_kernels``): int8 tensors between packed convs flow in the
    target's blocked NCHW[x]c layout (:mod:`autoq.cpu.blocked`), NCHW only at the edges;
    None (default): on for AVX-512 VNNI and AVX2 targets (both measured faster).
    ``residual_epilogue`` (with ``cpu_kernels``): a conv's residual add runs in the conv
    kernel's epilogue (:mod:`autoq.cpu.residual`; with the blocked layout the block outputs
    flow blocked too); None (default): on exactly when the blocked layout is.
    """
    use_machine_cores()  # this thread's pool on every core, before the model first runs
    target = target or default_target()
    if isinstance(target, dict):
        target = tvm.target.Target(target)
    mod = rewrite_float_ops(mod)  # float ops as the simulated graph computes them
    if cpu_kernels:
        require_amx(target)  # AMX kernels need the tile state granted before they run
        mod = lower_to_cpu_kernels(mod, target, blocked_layout, residual_epilogue)
    if database is not None:
        from autoq.build.tuning_database import pipeline_with_database

        return tvm.compile(mod, target, relax_pipeline=pipeline_with_database(target, database))
    pipeline = None
    if fuse:
        pipeline = _kernel_pipeline(target) if cpu_kernels else relax.get_default_pipeline(target)
    if pipeline is None:
        return tvm.compile(mod, target)
    return tvm.compile(mod, target, relax_pipeline=pipeline)


def _kernel_pipeline(target: tvm.target.Target):
    """TVM's default CPU pipeline with :class:`autoq.cpu.injective.ScheduleFused` after
    fusion (the fused elementwise functions run parallel instead of as naive loop nests), and
    no kernel that nothing calls (:func:`autoq.ir.cpu_pipeline.drop_unused_kernels`)."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    passes = [
        *cpu.library_dispatch_passes(target),
        *cpu.legalize_passes(target),
        ScheduleFused(),
        *cpu.dataflow_lower_passes(target),
        *cpu.finalize_passes(target),
    ]

    @tvm.transform.module_pass(opt_level=0, name="autoq.KernelPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return drop_unused_kernels(tvm.transform.Sequential(passes)(mod))

    return _pipeline


def export_library(
    mod: tvm.IRModule,
    path: str | Path,
    target=None,
    cpu_kernels: bool = True,
    database=None,
    output_names: list[str] | None = None,
) -> Path:
    """Compile ``mod`` (with the tuning ``database`` folder, if given) and write a shared
    library loadable with :func:`load_library` or :func:`autoq.load`, with its stamp
    ``<path>.autoq.json`` (id, size, SHA-256 and the inputs and outputs of ``main``, see
    :mod:`autoq.ir.library_file`). ``output_names``: names of ``main``'s outputs in order
    (e.g. the ONNX model's; default ``output_0``, ``output_1``, ...).

    The link runs in a work folder ``.<name>.autoq-build-<pid>-*`` next to ``path`` (TVM's
    object files and the compiler's temporary files: ``TMPDIR`` points there while it
    runs); the library and its stamp are moved into place when complete, and the folder is
    removed. A work folder left by a killed process is removed by the next export to the
    same name. Less free space than twice the weights plus 16 MiB is an ``OSError``
    (ENOSPC) before LLVM writes anything (LLVM ends the process when a write fails).
    Without a ``database`` the library comes from the compile cache when the same module
    was compiled before (:func:`cached_compile`): it is copied, nothing is compiled."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    signature = main_signature(mod, output_names)
    if database is None:
        cached, lib = cached_compile(mod, target, cpu_kernels)
    else:
        cached, lib = None, compile(mod, target, cpu_kernels=cpu_kernels, database=database)
    # LLVM ends the process when it cannot write an object file: check the space first
    need, st = 2 * sum(weight_bytes(mod).values()) + _SPARE_BYTES, os.statvfs(path.parent)
    if st.f_bavail * st.f_frsize < need:
        free = st.f_bavail * st.f_frsize
        raise OSError(errno.ENOSPC, f"{free} bytes free, {need} needed", str(path.parent))
    prefix = f".{path.name}.autoq-build-"
    remove_dead_dirs(path.parent, prefix)
    work = pid_dir(path.parent, prefix, 0o700)
    try:
        if cached is not None:  # (its integrity data stays inside; the new one is last)
            shutil.copyfile(cached, work / path.name)
        else:
            with temp_folder(work):
                lib.export_library(str(work / path.name), workspace_dir=str(work))
        stamp = write_stamp(work / path.name, signature)
        os.replace(work / path.name, path)
        os.replace(stamp, stamp_path(path))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def cached_compile(mod: tvm.IRModule, target=None, cpu_kernels: bool = True):
    """:func:`compile` (default options) through the compile cache
    (:mod:`autoq.ir.compile_cache`): ``(path of the cached library, None)``, or ``(None,
    the executable)`` when the cache is off or cannot be written. Whatever compiles a
    quantized module for this CPU (the export, a check of the result) shares one entry."""
    target = target or default_target()
    if isinstance(target, dict | str):
        target = tvm.target.Target(target)
    kind = f"autoq.build.compile(cpu_kernels={bool(cpu_kernels)})"
    code = mod  # the key: without autoq's own attributes (qparams, run statistics)
    for key in [k for k in (mod.attrs.keys() if mod.attrs else ()) if k.startswith("autoq.")]:
        code = code.without_attr(key)
    space = 2 * sum(weight_bytes(mod).values())  # (as export_library checks)
    build = lambda: compile(mod, target, cpu_kernels=cpu_kernels)  # noqa: E731
    return cached_library(code, target, kind, build, space)


def _tensor_info(name: str, sinfo) -> dict | None:
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        return None
    dims = []
    for d in sinfo.shape.values:
        try:
            dims.append(int(d))
        except (TypeError, ValueError):
            dims.append(None)  # a symbolic dimension
    return {"name": name, "shape": dims, "dtype": str(sinfo.dtype)}


def _flat(sinfo) -> list:
    if isinstance(sinfo, relax.TupleType):
        return [t for f in sinfo.fields for t in _flat(f)]
    return [sinfo]


def main_signature(mod: tvm.IRModule, output_names: list[str] | None = None) -> dict | None:
    """``{"inputs": [...], "outputs": [...]}`` of ``mod["main"]``: name, shape (None for a
    symbolic dimension) and dtype of each parameter and of each output (a tuple flattened);
    ``output_names`` when there are as many as outputs, else ``output_<k>``. None when a
    parameter or an output is not a tensor of known rank."""
    func = mod["main"]
    outs = _flat(func.ret_ty)
    names = list(output_names or [])
    if len(names) != len(outs) or len(set(names)) != len(names):
        names = [f"output_{k}" for k in range(len(outs))]
    inputs = [_tensor_info(p.name, p.ty) for p in func.params]
    outputs = [_tensor_info(n, s) for n, s in zip(names, outs, strict=True)]
    if None in inputs or None in outputs:
        return None
    return {"inputs": inputs, "outputs": outputs}


def load_library(path: str | Path, device=None) -> relax.VirtualMachine:
    """A VirtualMachine over a library written by :func:`export_library`; a missing,
    truncated, modified or foreign file, one without its stamp or under another library's
    stamp is a :class:`autoq.errors.LibraryError` naming it."""
    use_machine_cores()
    path = check_library(path)
    request_amx()  # a library built for an AMX target needs it; harmless elsewhere
    try:
        lib = tvm.runtime.load_module(str(path))
        return relax.VirtualMachine(lib, device or tvm.cpu())
    except Exception as e:  # dlopen errors, a library without a Relax VM executable
        raise LibraryError(
            f"{str(path)!r} cannot be loaded as an autoq/TVM model library: "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from None
