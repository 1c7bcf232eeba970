"""MetaSchedule tuning databases: where they live, how they are opened, and the Relax
pipeline that compiles a module with one.

A database is a folder holding ``database_workload.json`` and
``database_tuning_record.json`` (MetaSchedule's JSON database). It is keyed by the
*anchor block* of each fused kernel (``module_equality="anchor-block"``): the same conv or
matmul shape in another model, or the same model quantized again with other scales, reuses
the records. Tuning extracts its tasks from :func:`autoq.cpu_pipeline.fused` (the exact fusion of the
default CPU pipeline) and :func:`pipeline_with_database` applies the records at the same
point of the same pipeline, so keys always match.
"""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax

from .cpu_pipeline import cpu_pipeline, fused

__all__ = [
    "MODULE_EQUALITY",
    "RECORD_FILE",
    "WORKLOAD_FILE",
    "open_database",
    "pipeline_with_database",
    "tuned_kernels",
]

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
MODULE_EQUALITY = "anchor-block"


def open_database(folder: str | Path, create: bool = True):
    """The JSON database in ``folder`` (created empty when ``create``; otherwise a missing
    folder or file raises :class:`FileNotFoundError` naming it)."""
    from tvm.s_tir import meta_schedule as ms

    folder = Path(folder)
    if not create:
        for name in (WORKLOAD_FILE, RECORD_FILE):
            if not (folder / name).is_file():
                raise FileNotFoundError(
                    f"no tuning database in {str(folder)!r}: {name} is missing (run "
                    "'autoq tune' or autoq.tune(..., database=folder) first)"
                )
    folder.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(
        path_workload=str(folder / WORKLOAD_FILE),
        path_tuning_record=str(folder / RECORD_FILE),
        allow_missing=create,
        module_equality=MODULE_EQUALITY,
    )


def _register_if_used(folder: Path) -> None:
    from .x86_intrinsics import VNNI_INTRIN, register_vnni

    if VNNI_INTRIN in (folder / RECORD_FILE).read_text():
        register_vnni()  # records replay the VNNI tensorization


def tuned_kernels(
    mod: tvm.IRModule, target, folder: str | Path, cpu_kernels: bool = True
) -> tuple[list[str], list[str]]:
    """(kernels of ``mod`` that the database in ``folder`` has a schedule for, all the
    kernels tuning may schedule) after fusion, by PrimFunc name; ``cpu_kernels`` as in
    :func:`autoq.compile` (autoq's packed kernels keep their own schedules: not listed)."""
    from .cpu.injective import KERNEL_ATTR
    from .cpu.lowering import lower_to_cpu_kernels

    if cpu_kernels:
        mod = lower_to_cpu_kernels(mod, target)
    folder = Path(folder)
    database = open_database(folder, create=False)
    _register_if_used(folder)
    with target, database:
        mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(fused(mod, target))
    kernels = [
        gv.name_hint
        for gv, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and KERNEL_ATTR not in (f.attrs or {})
    ]
    done = [n for n in kernels if mod[n].attrs and mod[n].attrs.get("tirx.is_scheduled", False)]
    return sorted(done), sorted(kernels)


def pipeline_with_database(target, folder: str | Path):
    """The default CPU pipeline with ``MetaScheduleApplyDatabase`` right after fusion:
    every kernel with a record in the database in ``folder`` gets its tuned schedule, the
    others stay as the default pipeline leaves them."""
    database = open_database(folder, create=False)
    _register_if_used(Path(folder))

    def apply(mod: tvm.IRModule) -> tvm.IRModule:
        with database:
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        return _schedule_rest(mod)

    return cpu_pipeline(target, apply)


def _schedule_rest(mod: tvm.IRModule) -> tvm.IRModule:
    """The kernels the database did not schedule get the default pipeline's cheap schedule
    (:func:`autoq.cpu.injective.schedule_fused`); autoq's packed kernels keep theirs."""
    from .cpu.injective import KERNEL_ATTR, schedule_fused

    for gv, f in list(mod.functions_items()):
        if not isinstance(f, tvm.tirx.PrimFunc):
            continue
        attrs = f.attrs or {}
        if attrs.get("tirx.is_scheduled", False) or KERNEL_ATTR in attrs:
            continue
        mod[gv] = schedule_fused(f)
    return mod
