"""MetaSchedule tuning databases: where they live, how they are opened, and the Relax
pipeline that compiles a module with one.

A database is a folder holding ``database_workload.json`` and
``database_tuning_record.json`` (MetaSchedule's JSON database). It is keyed by the
*anchor block* of each fused kernel (``module_equality="anchor-block"``): the same conv or
matmul shape in another model, or the same model quantized again with other scales, reuses
the records. Tuning extracts its tasks from :func:`autoq.ir.cpu_pipeline.fused` (the exact fusion of the
default CPU pipeline) and :func:`pipeline_with_database` applies the records at the same
point of the same pipeline, so keys always match.
"""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import relax

from autoq.build.tuning_defaults import DefaultSchedules
from autoq.ir.cpu_pipeline import cpu_pipeline, fused
from autoq.ir.float_ops import rewrite_float_ops

__all__ = [
    "MODULE_EQUALITY",
    "RECORD_FILE",
    "WORKLOAD_FILE",
    "apply_database",
    "default_schedule",
    "open_database",
    "pipeline_with_database",
    "tuned_kernels",
    "workload_key",
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
    from autoq.cpu.x86_intrinsics import VNNI_INTRIN, register_vnni

    if VNNI_INTRIN in (folder / RECORD_FILE).read_text():
        register_vnni()  # records replay the VNNI tensorization


def workload_key(record) -> str:
    """The key of a record's workload in the database (its hash under ``MODULE_EQUALITY``):
    what :mod:`autoq.build.tuning_defaults` lists."""
    return str(record.workload.as_json()[0])


def default_schedule(func: tvm.tirx.PrimFunc, target) -> tvm.tirx.PrimFunc:
    """The schedule a kernel gets without a database (as ``autoq.compile`` gives it)."""
    from autoq.cpu.injective import schedule_fused
    from autoq.ir.loop_schedule import rows_for

    return schedule_fused(func, rows_for(target))


def _tunable(mod: tvm.IRModule) -> list:
    from autoq.cpu.injective import KERNEL_ATTR

    return [
        gv
        for gv, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and KERNEL_ATTR not in (f.attrs or {})
    ]


def apply_database(
    mod: tvm.IRModule, target, folder: str | Path, database=None, default_wins=None
) -> tvm.IRModule:
    """The fused ``mod`` with the records of the database in ``folder`` applied, except to
    the kernels whose default schedule measured faster (:mod:`autoq.build.tuning_defaults`); those
    and the kernels without a record get :func:`default_schedule`, autoq's packed kernels
    keep theirs. Call inside ``with target``. ``database`` / ``default_wins``: the opened
    database and the workload keys to keep the default for, when the caller has them (the
    tuner: its open database, and no exceptions while it measures records against
    defaults)."""
    folder = Path(folder)
    if database is None:
        database = open_database(folder, create=False)
        _register_if_used(folder)
    if default_wins is None:
        default_wins = DefaultSchedules.load(folder).default_wins()
    # the module MetaScheduleApplyDatabase looks a kernel up with (its own normalization)
    normalize = tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")
    kept = {}
    for gv in _tunable(mod):
        record = database.query_tuning_record(normalize(mod[gv]), target, gv.name_hint)
        if record is not None and workload_key(record) in default_wins:
            kept[gv] = mod[gv]
    with database:
        mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
    for gv in _tunable(mod):
        func = mod[gv]
        if gv in kept or not (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
            mod[gv] = default_schedule(kept.get(gv, func), target)
    return mod


def tuned_kernels(
    mod: tvm.IRModule, target, folder: str | Path, cpu_kernels: bool = True
) -> tuple[list[str], list[str]]:
    """(kernels of ``mod`` that get a schedule from the database in ``folder``, all the
    kernels tuning may schedule) after fusion, by PrimFunc name; ``cpu_kernels`` as in
    :func:`autoq.compile` (autoq's packed kernels keep their own schedules: not listed).
    Kernels whose default schedule beat their record are not in the first list."""
    from autoq.cpu.lowering import lower_to_cpu_kernels

    mod = rewrite_float_ops(mod)  # as autoq.compile does
    if cpu_kernels:
        mod = lower_to_cpu_kernels(mod, target)
    with target:
        mod = fused(mod, target)
        kernels = [gv.name_hint for gv in _tunable(mod)]
        mod = apply_database(mod, target, folder)
    done = [n for n in kernels if mod[n].attrs and mod[n].attrs.get("tirx.is_scheduled", False)]
    return sorted(done), sorted(kernels)


def pipeline_with_database(target, folder: str | Path):
    """The default CPU pipeline with :func:`apply_database` right after fusion: every
    kernel with a record in the database in ``folder`` that beat autoq's default schedule
    gets its tuned schedule, the others compile as without the database."""
    open_database(folder, create=False)  # a missing database fails here, not mid-compile
    DefaultSchedules.load(folder)  # as does a corrupt side file
    return cpu_pipeline(target, lambda mod: apply_database(mod, target, folder))
