"""Tuning on demand: MetaSchedule over a realized (int8) module, into a JSON database that
later compiles reuse.

``autoq.tune(qmod, target, trials=..., database=folder)`` fuses the module exactly as the
CPU pipeline does (:func:`autoq.ir.cpu_pipeline.fused`), extracts one task per distinct
anchor block (conv, matmul, ... with their fused epilogue; the same shape twice is one
task), drops the tasks the database already has records for, and tunes the rest with
MetaSchedule's evolutionary search and XGBoost cost model. ``autoq.compile(qmod,
database=folder)`` / ``autoq.export_library(..., database=folder)`` then apply the best
records. Tuning the same shapes again runs no trial at all.

Where the target has AVX-512 VNNI (e.g. ``mcpu`` ``znver4``, ``icelake-server``),
MetaSchedule's x86 rules add ``MultiLevelTilingWithIntrin("dot_16x4_vnni")`` to the search
space; :mod:`autoq.cpu.x86_intrinsics` makes that intrinsic compile with this TVM's LLVM.

Pitfalls this module handles (measured on TVM 0.27, see the notes in docs):

- the stock builder imports ``tvm.s_tir.tensor_intrin`` in each worker (20-90 s, see
  :mod:`autoq.cpu.tensor_intrinsics`; the tuning process imports it the fast way) and
  kills it after 30 s: every trial fails and "tuning" silently returns an untuned
  module. :func:`build_candidate` builds directly (candidates arrive already tensorized),
  and a tuning run whose every trial failed raises :class:`TuningError` with the first
  error instead of returning;
- tasks must come from the fused module (tuning the unfused module gives keys that never
  match at compile time) and be compared by anchor block.

Measurement runs locally (``LocalRunner``) or, with ``rpc=Tracker(host, port, key)``, on the
devices registered with a TVM RPC tracker (``python -m tvm.exec.rpc_tracker``, devices run
``python -m tvm.exec.rpc_server --tracker host:port --key KEY``).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path

import tvm
import tvm_ffi

from autoq.build.tuning_database import (
    apply_database,
    default_schedule,
    open_database,
    workload_key,
)
from autoq.build.tuning_defaults import DefaultSchedules, KernelChoice
from autoq.cpu.injective import KERNEL_ATTR
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.tensor_intrinsics import import_tensor_intrinsics
from autoq.cpu.x86_intrinsics import register_vnni, target_has_vnni
from autoq.ir.cpu_pipeline import fused
from autoq.ir.float_ops import rewrite_float_ops
from autoq.ir.target import default_target
from autoq.json_document import JsonDocument

__all__ = [
    "COST_MODELS",
    "Tracker",
    "TuneResult",
    "TuningError",
    "build_candidate",
    "measure_schedules",
    "tune",
    "tuning_target",
]


#: cost models offered by :func:`tune`
COST_MODELS = ("xgb", "random")


class TuningError(RuntimeError):
    """Tuning could not measure anything (every candidate failed to build or to run)."""


@dataclass(frozen=True)
class Tracker(JsonDocument):
    """A TVM RPC tracker whose devices measure the candidates: ``host``, ``port``, the
    device ``key`` the servers registered with, and how long one measurement session may
    take (``session_timeout_s``).

    >>> Tracker.parse("127.0.0.1:9190/rasp4")
    Tracker(host='127.0.0.1', port=9190, key='rasp4', session_timeout_s=60.0)
    """

    host: str
    port: int
    key: str
    session_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(
                f"Tracker.host must be a host name like '127.0.0.1', got {self.host!r}"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise TypeError(f"Tracker.port must be an int like 9190, got {self.port!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"Tracker.port must be in 1..65535, got {self.port}")
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(
                f"Tracker.key must be the --key the RPC servers registered with, got {self.key!r}"
            )
        if not self.session_timeout_s > 0:
            raise ValueError(
                f"Tracker.session_timeout_s must be > 0, got {self.session_timeout_s!r}"
            )

    @classmethod
    def parse(cls, text: str) -> Tracker:
        """``HOST:PORT/KEY`` (the command line's ``--rpc`` form)."""
        m = re.fullmatch(r"([^:/]+):(\d+)/(.+)", text.strip())
        if m is None:
            raise ValueError(f"expected HOST:PORT/KEY like 127.0.0.1:9190/rasp4, got {text!r}")
        return cls(m.group(1), int(m.group(2)), m.group(3))

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> Tracker:
        known = {f.name for f in fields(cls)}
        if set(d) - known:
            raise ValueError(
                f"Tracker has no fields {sorted(set(d) - known)}; it has {sorted(known)}"
            )
        return cls(**d)


@dataclass(frozen=True)
class TuneResult:
    """What one :func:`tune` call did: the ``database`` folder, how many distinct kernels
    (``tasks``) the module has, how many were already in the database (``reused``), how many
    trials were measured now (``trials``, ``failed`` of them), the wall time, and how many
    kernels keep autoq's default schedule because it measured faster than their best
    record (``kept_default``; their records are not applied, see
    :mod:`autoq.build.tuning_defaults`)."""

    database: Path
    tasks: int
    reused: int
    trials: int
    failed: int
    seconds: float
    kept_default: int = 0

    def summary(self) -> str:
        kept = f"; {self.kept_default} keep the default schedule (faster than their records)"
        if self.tasks == self.reused:
            return (
                f"all {self.tasks} kernels already tuned in {self.database} (no new trials){kept}"
            )
        return (
            f"{self.tasks} kernels ({self.reused} already tuned), {self.trials} trials "
            f"({self.failed} failed) in {self.seconds:.0f} s -> {self.database}{kept}"
        )


def tuning_target(target=None) -> tvm.target.Target:
    """``target`` (default: this CPU) with ``num-cores`` set (MetaSchedule needs it): the
    machine's physical cores unless the target says otherwise."""
    target = target or default_target()
    if isinstance(target, dict):
        target = tvm.target.Target(target)
    if target.kind.name != "llvm" or "num-cores" in target.attrs:
        return target
    spec = dict(target.export())
    spec["num-cores"] = _physical_cores()
    return tvm.target.Target(spec)


def _physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def build_candidate(mod: tvm.IRModule, target, _params=None):
    """The builder workers' build: the candidate arrives scheduled (and tensorized), so
    unlike MetaSchedule's default build this imports no tensor intrinsics."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def _check_args(trials, database, cost_model) -> None:
    if database is None:
        raise ValueError("autoq.tune needs database=FOLDER (where the tuning records are kept)")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be a positive int, got {trials!r}")
    if cost_model not in COST_MODELS:
        raise ValueError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {cost_model!r}")
    _check_deps()


def _check_deps() -> None:
    import importlib.util

    missing = [
        m for m in ("psutil", "xgboost", "cloudpickle") if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ImportError(
            f"autoq.tune needs {', '.join(missing)}: pip install 'autoq[tune]' "
            f"(or pip install {' '.join(missing)})"
        )


class _Workers:
    """MetaSchedule's builder and runner, started on first use: their constructors start
    and sanity-check worker processes (~10-20 s), which a run with nothing to tune or
    measure does not need."""

    def __init__(self, rpc: Tracker | None):
        self.rpc = rpc
        self._pair = None

    def get(self):
        if self._pair is None:
            self._pair = _builder_runner(self.rpc, max(1, _physical_cores()))
        return self._pair


def _builder_runner(rpc: Tracker | None, workers: int):
    from tvm.s_tir import meta_schedule as ms

    builder = ms.builder.LocalBuilder(
        f_build=build_candidate, max_workers=workers, timeout_sec=120.0
    )
    evaluator = ms.runner.EvaluatorConfig(
        number=3, repeat=1, min_repeat_ms=20, enable_cpu_cache_flush=False
    )
    if rpc is None:
        return builder, ms.runner.LocalRunner(timeout_sec=60.0, evaluator_config=evaluator)
    config = ms.runner.RPCConfig(
        tracker_host=rpc.host,
        tracker_port=rpc.port,
        tracker_key=rpc.key,
        session_timeout_sec=int(rpc.session_timeout_s),
    )
    return builder, ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator)


def _progress_callback(total: int, progress: bool, counts: dict):
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    from autoq.config.progress import bar as progress_bar

    bar = progress_bar(total=total, desc="tuning", unit="trial", show=progress)

    @derived_object
    class _Progress(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, candidates, builds, runs) -> None:
            for b, r in zip(builds, runs, strict=True):
                counts["trials"] += 1
                error = b.error_msg or r.error_msg
                if error:
                    counts["failed"] += 1
                    counts.setdefault("first_error", str(error))
            bar.update(len(runs))
            bar.set_postfix_str(f"task {task_id}, {counts['failed']} failed")

    return _Progress(), bar


def _search(per_task: int):
    """Evolutionary search sized to the budget (MetaSchedule's default population of 512
    costs ~40 s per round on 2 busy cores, wasted when a kernel gets a handful of trials)."""
    from tvm.s_tir import meta_schedule as ms

    population = max(64, min(512, 16 * per_task))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(50, population // 2)
    )


def _contexts(tasks, strategy, seed: int | None) -> list:
    """One TuneContext per task, logging to the ``autoq.tuning`` logger (MetaSchedule's own
    helper reconfigures the process's logging on every call, and fails on the second call
    when another library added an unnamed handler)."""
    import logging

    from tvm.s_tir import meta_schedule as ms

    logger = logging.getLogger("autoq.tuning")
    return [
        ms.TuneContext(
            mod=t.dispatched[0],
            target=t.target,
            space_generator="post-order-apply",
            search_strategy=strategy,
            task_name=t.task_name,
            logger=logger,
            rand_state=-1 if seed is None else seed + i,
            num_threads="physical",
        ).clone()
        for i, t in enumerate(tasks)
    ]


def _scheduled(mod: tvm.IRModule) -> bool:
    """A task MetaSchedule must not touch: already scheduled, or one of autoq's packed
    kernels (fixed, tensorized schedules: :mod:`autoq.cpu`)."""
    if mod.attrs is not None and mod.attrs.get("tirx.is_scheduled", False):
        return True
    for _, f in mod.functions_items():
        attrs = f.attrs or {}
        if attrs.get("tirx.is_scheduled", False) or KERNEL_ATTR in attrs:
            return True
    return False


def _pending_tasks(mod, target, database):
    """(all extracted tasks, those without a record in ``database``)."""
    from tvm.s_tir import meta_schedule as ms

    tasks = ms.relax_integration.extract_tasks(mod, target, module_equality="anchor-block")
    tasks = [t for t in tasks if not _scheduled(t.dispatched[0])]
    pending = [
        t
        for t in tasks
        if database.query_tuning_record(t.dispatched[0], target, t.task_name) is None
    ]
    return tasks, pending


def measure_schedules(mods: list, target, workers: _Workers) -> list[float | None]:
    """Mean seconds per call of each scheduled one-kernel module (``main``), built and run
    by MetaSchedule's builder and runner (``workers``) exactly as tuning candidates are;
    None where the build or the run failed."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    builder, runner = workers.get()
    builds = builder.build([BuilderInput(m, target) for m in mods])
    ran = [i for i, b in enumerate(builds) if b.error_msg is None]
    device = "cpu" if target.kind.name == "llvm" else target.kind.name
    inputs = [
        RunnerInput(builds[i].artifact_path, device, ArgInfo.from_prim_func(mods[i]["main"]))
        for i in ran
    ]
    seconds: list[float | None] = [None] * len(mods)
    for i, future in zip(ran, runner.run(inputs), strict=True):
        result = future.result()
        if result.error_msg is None and result.run_secs:
            secs = [float(s) for s in result.run_secs]
            seconds[i] = sum(secs) / len(secs)
    return seconds


def _measure_defaults(tasks, target, db, folder: Path, workers: _Workers) -> int:
    """Measure, for every task with a record that was not measured before (or whose default
    schedule changed since), autoq's default schedule and the schedule the database gives
    it, in one batch with the tuning builder and runner (``workers``); record the outcome in
    the database's side file (:class:`autoq.build.tuning_defaults.DefaultSchedules`).
    Returns how many of ``tasks`` keep the default schedule."""
    choices = DefaultSchedules.load(folder)
    measured = choices.measured()
    keys, todo = {}, {}
    with target:
        for t in tasks:
            record = db.query_tuning_record(t.dispatched[0], target, t.task_name)
            if record is None:
                continue
            key = keys[t.task_name] = workload_key(record)
            default = default_schedule(t.dispatched[0]["main"], target)
            fingerprint = str(tvm_ffi.structural_hash(default))
            if measured.get(key) != fingerprint and key not in todo:
                todo[key] = (t, default, fingerprint)
        mods = []
        for t, default, _ in todo.values():
            mods.append(tvm.IRModule({"main": default}))
            # the record itself, also where an older default won: it is measured again
            mods.append(apply_database(t.dispatched[0], target, folder, db, frozenset()))
    if todo:
        secs = measure_schedules(mods, target, workers)
        new = [
            KernelChoice(key, t.task_name, secs[2 * i], secs[2 * i + 1], fingerprint)
            for i, (key, (t, _, fingerprint)) in enumerate(todo.items())
        ]
        choices = choices.with_kernels(new)
        choices.save_to(folder)
    wins = choices.default_wins()
    return sum(1 for key in keys.values() if key in wins)


def tune(
    qmod: tvm.IRModule,
    target=None,
    trials: int = 64,
    database: str | Path | None = None,
    rpc: Tracker | None = None,
    *,
    trials_per_task: int | None = None,
    progress: bool = True,
    seed: int | None = None,
    cost_model: str = "xgb",
    cpu_kernels: bool = True,
) -> TuneResult:
    """Tune the kernels of ``qmod`` into the JSON database in folder ``database``.

    ``trials``: the budget over all kernels not yet in the database (MetaSchedule's
    gradient task scheduler spends it where it gains most); ``trials_per_task`` caps one
    kernel (default ``trials``). ``rpc``: measure on the devices of an RPC tracker instead
    of this machine. ``cost_model``: "xgb" (learned, the default) or "random" (no training:
    for tiny budgets). The search population grows with the per-kernel budget (64..512
    candidates), so small budgets do not pay for a full-size search. Kernels already in
    the database are not tuned again. ``cpu_kernels``: as in :func:`autoq.compile` (True:
    the int8 convs/matmuls run on autoq's packed kernels, which keep their fixed schedules,
    and the rest of the module is tuned; compile with the same value). Returns what was
    done (:class:`TuneResult`); compile with ``autoq.compile(qmod, target,
    database=database)``. Raises :class:`TuningError` when every trial failed.

    After the search, each tuned kernel's best record and autoq's default schedule for it
    are measured together (same builder and runner); where the record is not at least
    3% faster, compiles keep the default (:mod:`autoq.build.tuning_defaults`), so tuning never
    makes a kernel slower than untuned. That costs two builds and runs per kernel, once."""
    _check_args(trials, database, cost_model)
    t0 = time.perf_counter()
    target = tuning_target(target)
    import_tensor_intrinsics()  # before MetaSchedule's TuneContext imports them slowly
    if target_has_vnni(target):
        register_vnni()
    folder = Path(database)
    db = open_database(folder)
    qmod = rewrite_float_ops(qmod)  # the kernels the build will have
    if cpu_kernels:
        qmod = lower_to_cpu_kernels(qmod, target)
    tasks, pending = _pending_tasks(fused(qmod, target), target, db)
    workers = _Workers(rpc)
    counts = {"trials": 0, "failed": 0}
    if pending:
        per_task = min(trials_per_task or trials, trials)
        budget = _Budget(trials, per_task, cost_model, progress)
        contexts = _contexts(pending, _search(per_task), seed)
        _tune_pending(contexts, pending, db, folder, *workers.get(), budget, counts)
    kept = _measure_defaults(tasks, target, db, folder, workers)
    return TuneResult(
        folder,
        len(tasks),
        len(tasks) - len(pending),
        counts["trials"],
        counts["failed"],
        time.perf_counter() - t0,
        kept,
    )


@dataclass(frozen=True)
class _Budget:
    trials: int
    per_task: int
    cost_model: str
    progress: bool


def _tune_pending(contexts, pending, db, folder, builder, runner, budget: _Budget, counts):
    """MetaSchedule's task scheduler over the ``pending`` tasks (their ``contexts``);
    ``counts`` gets the trials measured and failed."""
    from tvm.s_tir import meta_schedule as ms

    trials, per_task = budget.trials, budget.per_task
    total = min(trials, per_task * len(pending))
    callback, bar = _progress_callback(total, budget.progress, counts)
    try:
        ms.tune.tune_tasks(
            tasks=contexts,
            task_weights=[float(t.weight) for t in pending],
            work_dir=str(folder),
            max_trials_global=trials,
            max_trials_per_task=per_task,
            num_trials_per_iter=min(64, per_task),
            builder=builder,
            runner=runner,
            database=db,
            cost_model=budget.cost_model,
            measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"), callback],
            module_equality="anchor-block",
        )
    finally:
        bar.close()
    if counts["trials"] and counts["failed"] == counts["trials"]:
        raise TuningError(
            f"all {counts['trials']} tuning trials failed; the first error: "
            f"{counts.get('first_error', '?')[:2000]}"
        )
