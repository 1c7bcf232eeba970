"""Data-parallel calibration on a Dask cluster (optional extra ``autoq[dask]``).

``autoq.quantize(mod, params, dataset, distributed=Distributed(workers=2))`` (or
``cluster=`` a ``dask.distributed.Client`` / a scheduler address, or ``autoq quantize
--scheduler ADDRESS`` / ``--workers N``) calibrates like this:

1. the coordinator (this process) compiles the calibration graph once and ships the exported
   library with the plain-data plan (:mod:`autoq.calibration.plan`) to one
   :class:`autoq.distributed.shard_actor.ShardActor` per shard, a Dask *actor* living in a worker;
2. the samples are split into shards: a shard source (:mod:`autoq.dataset.shards`: ``.npz``
   files or an image folder on a shared path, a function ``shard(i, n)``) is read by the
   workers themselves, so the coordinator never holds the dataset; any other dataset is
   streamed from the coordinator to the shards, sample ``k`` to shard ``k % n``, a few at a
   time;
3. :func:`autoq.calibration.run_plan` runs unchanged over :class:`autoq.distributed.remote_shards.
   RemoteShard` proxies: for each segment of the topological plan every shard sends its
   observer *states* for the segment's slots, the coordinator merges them (exactly: see
   :mod:`autoq.calibrators`), picks the qparams and sends them back with the segment to run.
   In ``fp32`` mode each shard streams its samples through the float graph once (twice for
   histogram calibrators) and sends its states.
4. weight tuning (``Config.weight_rounding="gptq"``, ``bias_correction``,
   :mod:`autoq.accuracy.weight_tuning`) runs in the same loop: before a segment, every shard sums
   the Hessian ``X^T X`` and the mean input of the layers reading the segment's heads over
   its samples (in int64 over the input's integer codes: exact, so the merged sums do not
   depend on the split or the merge order, :class:`autoq.accuracy.hessian.CodeHessian`); the
   coordinator merges them, runs GPTQ and the bias correction (both need only these sums)
   and sends the tuned weights and biases to the
   shards, which recompute their prologue before the segment runs. Empirical bias
   correction's fp32 mean patches come from one float-graph pass on the shards, per-sample
   sums added in dataset order (the in-process bits); with ``BiasCorrection.holdout`` the
   last samples go to a shard of their own that runs every segment but gives no
   statistics, whose rows the held-out gate reads (:mod:`autoq.accuracy.bias_gate`).

The qparams are the same bit for bit as in-process calibration, for any number of shards
and workers (``tests/test_distributed.py``). A worker that dies during topological
calibration has its shards restarted on another worker (``Distributed.retries`` times: the
samples reloaded, the segments so far replayed, the same result); otherwise the run fails
with :class:`ShardLostError` naming the shard. Nothing is silently calibrated on fewer
samples.
Only this module imports Dask, and only when a distributed run is asked for.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import time
from dataclasses import fields

from autoq import calibrators
from autoq.accuracy.weight_tuning import WeightTuner, distinct_values
from autoq.calibration import (
    bias_holdout_count,
    calibrate_weights,
    calibration_pipeline,
    checked_result,
    fp32_observers,
    fp32_slot_functions,
    make_qparams,
    refuse_constant_inputs,
    run_plan,
    samples_for,
    split_bias_holdout,
    static_values,
    warn_untuned,
)
from autoq.calibration.pending import ShardLostError, result_of
from autoq.calibration.plan import build_plan
from autoq.calibration.scale_health import HealthCheck
from autoq.config import Config, Distributed, Resources
from autoq.dataset import InputSpec, as_dataset, is_shard_source
from autoq.distributed.remote_shards import RemoteShard
from autoq.distributed.shard_actor import ShardActor, shard_name
from autoq.errors import InputError
from autoq.ir.toolkit import compile_executable
from autoq.rules.range_cuts import cut_ranges
from autoq.simulation import SimResult

__all__ = [
    "CONNECT_TIMEOUT_S",
    "PER_CHANNEL_RULES",
    "AnalysisFanOut",
    "ShardLostError",
    "ShardSet",
    "calibrate_distributed",
    "check_rules_in_process",
    "head_samples",
    "input_specs",
    "library_bytes",
    "open_client",
    "report_distributed",
]

#: samples sent to a shard per call when the coordinator streams the dataset
PUSH_CHUNK = 8
#: seconds to connect to a scheduler by its address (at most ``Distributed.timeout_s``): a
#: running scheduler answers in milliseconds, a wrong address should fail fast
CONNECT_TIMEOUT_S = 5.0


def _dask():
    try:
        import distributed
    except ImportError:
        raise ImportError(
            "distributed calibration needs Dask: pip install 'autoq[dask]' "
            "(or 'dask[distributed]'), or calibrate in-process (distributed=None)"
        ) from None
    return distributed


@contextlib.contextmanager
def open_client(dist: Distributed | None, cluster=None):
    """A ``dask.distributed.Client``: ``cluster`` itself when it is one (left open), a
    client of the scheduler at ``cluster`` (an address) or ``dist.scheduler``, or of a
    local cluster of ``dist.workers`` processes started here (closed on exit)."""
    distributed = _dask()
    if isinstance(cluster, distributed.Client):
        yield cluster
        return
    timeout = dist.timeout_s if dist is not None else 60.0
    with contextlib.ExitStack() as stack:
        address = cluster if isinstance(cluster, str) else dist.scheduler if dist else None
        if address is None and (dist is None or dist.workers is None):
            raise ValueError(
                f"cluster must be a dask.distributed.Client or a scheduler address, got {cluster!r}"
            )
        if address is None:
            local = distributed.LocalCluster(
                n_workers=dist.workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
            )
            stack.enter_context(local)
            address = local
        if isinstance(address, str):
            wait = min(timeout, CONNECT_TIMEOUT_S)
            try:
                client = stack.enter_context(distributed.Client(address, timeout=wait))
            except (OSError, TimeoutError) as e:
                raise InputError(
                    f"cannot reach the Dask scheduler at {address!r} within {wait:g} s "
                    f"({type(e).__name__}: {str(e)[:120]}): check the address and that the "
                    "scheduler is running, or calibrate in-process"
                ) from None
        else:
            client = stack.enter_context(distributed.Client(address, timeout=timeout))
        if dist is not None and dist.workers is not None:
            client.wait_for_workers(dist.workers, timeout=timeout)
        yield client


def library_bytes(functions: dict, target, base=None) -> bytes:
    """``functions`` compiled like in-process calibration does
    (:func:`autoq.ir.toolkit.compile_executable` with :func:`autoq.calibration.calibration_pipeline`)
    and exported as the bytes of a shared library, for :func:`autoq.distributed.shard_actor.load_vm`."""
    ex = compile_executable(functions, target, base, calibration_pipeline(target))
    with tempfile.TemporaryDirectory(prefix="autoq-lib-") as d:
        path = os.path.join(d, "calibration.so")
        ex.export_library(path)
        with open(path, "rb") as f:
            return f.read()


def head_samples(dataset, inputs, k: int = 2) -> list[dict]:
    """The first ``k`` samples (a shard source: of its first shard), e.g. for the
    unbounded-activation guard; the coordinator reads no more than these."""
    if is_shard_source(dataset):
        return list(itertools.islice(dataset.shard(0, 1), k))
    return list(itertools.islice(samples_for(dataset, inputs), k))


def input_specs(inputs) -> list[InputSpec]:
    """The :class:`InputSpec` of each model input Var (what the shards validate against)."""
    return [
        InputSpec(v.name, tuple(int(d) for d in v.ty.shape.values), str(v.ty.dtype)) for v in inputs
    ]


class ShardSet:
    """The shard actors of one run, created on ``client``'s workers (shard ``i`` on worker
    ``i % workers``) with their samples loaded (see the module docstring). Use as a context
    manager: the actors are released on exit."""

    def __init__(self, client, specs: list[InputSpec], dataset, resources: Resources, shards=None):
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        if not workers:
            raise RuntimeError("the Dask cluster has no workers")
        dist = resources.distributed
        n = shards or (dist.shards if dist is not None and dist.shards else len(workers))
        self.client, self.count = client, n
        self.workers = [workers[i % len(workers)] for i in range(n)]
        self.dataset, self.specs, self.resources = dataset, specs, resources
        self.names = [shard_name(i, n) for i in range(n)]
        futures = [self._actor(i, w) for i, w in enumerate(self.workers)]
        self.actors = [result_of(f, s, "start") for f, s in zip(futures, self.names, strict=True)]
        try:
            self.counts = self._load(range(n))
            self._check_counts()
        except BaseException:
            self.close()
            raise

    def _actor(self, i: int, worker: str):
        """The future of a new, empty actor for shard ``i`` on ``worker``."""
        budget = self.resources.memory_budget_mb * 2**20
        return self.client.submit(
            ShardActor, i, self.count, self.specs, budget, self.resources.cache_dir,
            actor=True, workers=[worker], allow_other_workers=False, pure=False,
        )  # fmt: skip

    def _load(self, shards) -> list[int]:
        """Load the samples of ``shards`` (indices) into their actors; every shard's count."""
        n, dataset = self.count, self.dataset
        counts = [0] * n
        if is_shard_source(dataset):
            futs = {i: self.actors[i].read(dataset) for i in shards}
            for i, f in futs.items():
                counts[i] = result_of(f, self.names[i], "reading")
            return counts
        pending: list = [None] * n
        chunks: list[list] = [[] for _ in range(n)]
        for k, sample in enumerate(as_dataset(dataset, self.specs)):
            i = k % n
            if i not in shards:
                continue
            chunks[i].append(sample)
            if len(chunks[i]) == PUSH_CHUNK:
                pending[i] = self._push(i, chunks[i], pending[i], counts)
                chunks[i] = []
        for i in shards:
            if chunks[i]:
                pending[i] = self._push(i, chunks[i], pending[i], counts)
            self._confirm(i, pending[i], counts)
        return counts

    def restart(self, i: int):
        """A new actor for shard ``i`` on a live worker (another one than its last, if
        any), holding the shard's samples again (re-read, or streamed again from the
        dataset); replaces the old one. Raises :class:`ShardLostError` when that fails."""
        live = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        others = [w for w in live if w != self.workers[i]] or live
        if not others:
            raise ShardLostError(f"{self.names[i]}: no live worker to restart it on")
        worker = others[i % len(others)]
        self.actors[i] = result_of(self._actor(i, worker), self.names[i], "restart")
        self.workers[i] = worker
        count = self._load([i])[i]
        if count != self.counts[i]:
            raise ShardLostError(
                f"{self.names[i]} reloaded {count} samples, it held {self.counts[i]}: the "
                "dataset did not give the same samples again (a one-shot iterator?)"
            )
        return self.actors[i]

    def _check_counts(self) -> None:
        n, counts = self.count, self.counts
        empty = [s for s, c in zip(self.names, counts, strict=True) if c == 0]
        if empty:
            raise ValueError(
                f"{', '.join(empty)} got no samples ({sum(counts)} samples for {n} shards): "
                "use fewer shards (Distributed(shards=...)) or more samples"
            )

    def _push(self, i: int, chunk: list, pending, counts: list[int]):
        """Send a chunk to shard ``i`` once its previous chunk has arrived (at most one
        chunk per shard in flight: the coordinator holds a few samples, not the dataset)."""
        self._confirm(i, pending, counts)
        counts[i] += len(chunk)
        return self.actors[i].add(chunk)

    def _confirm(self, i: int, pending, counts: list[int]) -> None:
        if pending is None:
            return
        held = result_of(pending, self.names[i], "loading samples")
        if held != counts[i]:  # a restarted worker made a fresh, empty actor
            raise ShardLostError(
                f"{self.names[i]} holds {held} samples, {counts[i]} were sent: its worker was "
                "restarted during loading"
            )

    def order(self, source: bool) -> list[tuple[int, int]]:
        """``(shard, index in shard)`` of every sample in dataset order: sample ``k`` of a
        streamed dataset is ``(k % n, k // n)``; a shard source's order is shard by shard."""
        if source:
            return [(i, j) for i, c in enumerate(self.counts) for j in range(c)]
        return [(k % self.count, k // self.count) for k in range(sum(self.counts))]

    def remotes(self, retries: int = 0) -> list[RemoteShard]:
        """The shards for :func:`autoq.calibration.run_plan`; a lost one is restarted
        (:meth:`restart`) up to ``retries`` times."""
        return [
            RemoteShard(
                self.actors[i], self.names[i], self.counts[i],
                f"samples {i}, {i + self.count}, ... of the dataset",
                restart=lambda i=i: self.restart(i), retries=retries,
            )
            for i in range(self.count)
        ]  # fmt: skip

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every shard at once; their results in shard order."""
        futs = [getattr(a, method)(*args) for a in self.actors]
        return [result_of(f, s, method) for f, s in zip(futs, self.names, strict=True)]

    def info(self) -> list[dict]:
        return [{**d, "worker": w} for d, w in zip(self.call("info"), self.workers, strict=True)]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("close")
        self.actors = []

    def __enter__(self) -> ShardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def calibrate_distributed(
    sim: SimResult, dataset, config: Config, target, client, resources: Resources | None = None,
    shards: int | None = None,
):  # fmt: skip
    """:func:`autoq.calibration.calibrate` on ``client``'s workers (see the module
    docstring): the same :class:`autoq.qparams.QParams`, bit for bit. ``dataset``: any
    dataset, or a shard source read by the workers. ``shards``: overrides
    ``resources.distributed.shards``. ``meta["stats"]`` adds the per-shard timings."""
    resources = resources or Resources()
    check_rules_in_process(config)
    for sid in sim.activation_slots():
        calibrators.check_mergeable(sim.plan.specs[sid].calibrator)
    t0 = time.perf_counter()
    result = calibrate_weights(sim)
    stats: dict[str, float] = {"weights_s": time.perf_counter() - t0}
    if not sim.activation_slots():  # no layer left to quantize: nothing for the workers
        return make_qparams(sim, result, config, None, stats, {}, None)
    specs = input_specs(sim.graph.inputs)
    dataset, held = _split_held(dataset, config)
    t1 = time.perf_counter()
    health: dict = {}  # the scale health of the activation slots (topological mode)
    with contextlib.ExitStack() as stack:
        shard_set = stack.enter_context(ShardSet(client, specs, dataset, resources, shards))
        held_set = (
            stack.enter_context(ShardSet(client, specs, held, resources, 1)) if held else None
        )
        stats["load_s"] = time.perf_counter() - t1
        stats["shards"] = shard_set.count
        tuner = None
        if config.calibration == "fp32":
            acts = _fp32(sim, shard_set, target, stats, health, config)
        else:
            acts, tuner = _topological(
                sim, (shard_set, held_set), result, (config, resources), target, stats, health
            )
        for i, d in enumerate(shard_set.info()):
            stats[f"shard{i}_peak_rss_mb"] = d["peak_rss_mb"]
        n = sum(shard_set.counts)
    stats["total_s"] = time.perf_counter() - t0
    refuse_constant_inputs(sim, health, n)
    warn_untuned(config)
    result.update(acts)
    return make_qparams(sim, result, config, n, stats, health, tuner)


#: activation rules whose statistics the workers cannot compute (they are per tensor)
PER_CHANNEL_RULES = ("lookup_per_channel", "depthwise_per_channel", "residual_per_channel")


def check_rules_in_process(config: Config) -> None:
    """A per-channel activation rule (``Config.rules``, also through a recipe) is an
    :class:`autoq.errors.InputError` naming it: the workers' statistics are per tensor."""
    used = [r for r in PER_CHANNEL_RULES if config.has_rule(r)]
    if used:
        raise InputError(
            f"Config.rules {used} (recipe {config.recipe!r}) are not supported with distributed "
            "calibration (the workers' statistics are per tensor): calibrate in-process, or "
            "give Config(rules=()) or another recipe"
        )


class AnalysisFanOut:
    """The per-layer analysis and the automatic fallback's SQNR trials with the samples'
    work on ``client``'s workers (``fan_out`` of :func:`autoq.fallback.auto_fallback.auto_fallback`).

    Called with the coordinator's (compiled) :class:`autoq.fallback.analysis.Analysis` of ``mod``
    (the model it was built from), it starts one analysis per shard (compiled there, kept
    with its samples) and returns ``(report, sqnr)``: the report from the shards'
    per-sample sums, added in dataset order, and ``sqnr(disabled)`` that runs a trial on
    every shard and adds their output sums in dataset order. Both equal the in-process
    results (the same float additions). A context manager: the shards are released on exit.
    """

    def __init__(self, client, mod, params, dataset, shards: int | None = None, resources=None):
        self.client, self.mod, self.params = client, mod, params
        self.dataset, self.shards = dataset, shards
        self.resources = resources or Resources()
        self.shard_set: ShardSet | None = None

    def __call__(self, analysis):
        from autoq.metrics import sqnr_of_sums

        self.close()
        specs = input_specs(analysis.sim.graph.inputs)
        ss = self.shard_set = ShardSet(
            self.client, specs, self.dataset, self.resources, self.shards
        )
        ss.call(
            "start_analysis",
            self.mod,
            self.params,
            analysis.qparams,
            analysis.config,
            analysis.target,
            analysis.accumulator,
        )
        order = ss.order(is_shard_source(self.dataset))
        report = analysis.report_from_shards(ss.call("analysis_sums"), order)

        def sqnr(disabled) -> float:
            per_shard = ss.call("trial_sums", list(disabled))
            return sqnr_of_sums([per_shard[i][j] for i, j in order])

        return report, sqnr

    def close(self) -> None:
        if self.shard_set is not None:
            self.shard_set.close()
            self.shard_set = None

    def __enter__(self) -> AnalysisFanOut:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def report_distributed(
    analysis, mod, params, dataset, client, shards: int | None = None, resources=None
):
    """:meth:`autoq.fallback.analysis.Analysis.report` with the samples' work on ``client``'s
    workers (see :class:`AnalysisFanOut`): the same report."""
    with AnalysisFanOut(client, mod, params, dataset, shards, resources) as fan_out:
        return fan_out(analysis)[0]


def _split_held(dataset, config: Config) -> tuple:
    """(calibration samples, held-out samples) for ``BiasCorrection.holdout``."""
    n = bias_holdout_count(config)
    if n and is_shard_source(dataset):
        raise ValueError(
            f"BiasCorrection.holdout={n} needs the samples streamed from this process; "
            f"a worker-side shard source ({dataset.describe()}) cannot be split: set it to 0"
        )
    return split_bias_holdout(dataset, config)


def _fp32_means(sim, tuner, plan, sets, config, target, stats) -> None:
    """Empirical bias correction's fp32 pass on the shards (``sets``: the calibration
    :class:`ShardSet` and the held-out one or None): per-sample sums added in dataset order,
    the held-out shard's fp32 rows, given to ``tuner``."""
    t0 = time.perf_counter()
    shard_set, held_set = sets
    g, slots = sim.graph, tuner.fp32_slots()
    lib = library_bytes(fp32_slot_functions(sim, slots), target, g.module)
    weights = [g.params[p.name] for p in g.weight_params]
    for ss in (s for s in sets if s is not None):
        ss.call("start_fp32", lib, [v.name for v in g.inputs], weights)
    tables, sinks = tuner.fp32_tables(), tuner.held_sinks()
    means = [distinct_values(t) for t in tables.values()]
    per_shard = shard_set.call("fp32_patch_sums", means)
    for i, j in shard_set.order(is_shard_source(shard_set.dataset)):
        for ms, sums in zip(means, per_shard[i][j], strict=True):
            for m, (s, n) in zip(ms, sums, strict=True):
                m.add(s, n)
    if held_set is not None and sinks:
        fed = held_set.call("fp32_feed", list(sinks.values()))[0]
        sinks = dict(zip(sinks, fed, strict=True))
    tuner.use_fp32(tables, sinks)
    stats["fp32_means_s"] = time.perf_counter() - t0


def _topological(sim, sets: tuple, weight_qp, settings, target, stats, health) -> tuple:
    """``sets``: the calibration :class:`ShardSet` and the held-out one (or None);
    ``settings``: (config, resources)."""
    shard_set, held_set = sets
    config, resources = settings
    plan, functions = build_plan(sim)
    t0 = time.perf_counter()
    lib = library_bytes(functions, target, sim.mod)
    stats["compile_s"] = time.perf_counter() - t0
    stats["segments"] = len(plan.segments)
    t0 = time.perf_counter()
    dist = resources.distributed  # cluster= without it: Distributed's default retries
    default = {f.name: f.default for f in fields(Distributed)}["retries"]
    retries = dist.retries if dist is not None else default
    remotes = shard_set.remotes(retries)
    held = [] if held_set is None else held_set.remotes(retries)
    static = static_values(sim, plan, weight_qp)
    for r in [*remotes, *held]:
        r.submit("start_topological", lib, plan, static, what="start")
    for r in [*remotes, *held]:
        r.wait()
    stats["start_s"] = time.perf_counter() - t0
    tuner = WeightTuner(sim, config, weight_qp, plan) if config.tunes_weights else None
    if tuner is not None and tuner.fp32_slots():
        _fp32_means(sim, tuner, plan, sets, config, target, stats)
    t0 = time.perf_counter()
    result = run_plan(
        plan, remotes, sim.plan.specs, config, sim, health, tuner, None, held, resources
    )
    for r in [*remotes, *held]:
        r.wait()
    stats["run_plan_s"] = time.perf_counter() - t0
    for i, d in enumerate(shard_set.call("finish_topological")):
        for k in ("run_s", "observe_s", "cache_peak_mb", "spilled_mb"):
            stats[f"shard{i}_{k}"] = d[k]
    if held_set is not None:
        held_set.call("finish_topological")
        stats["held_out_samples"] = sum(held_set.counts)
    missing = [s for s in sim.activation_slots() if s not in result]
    if missing:
        raise RuntimeError(f"internal error: activation slots {missing} were never calibrated")
    return result, tuner


def _fp32(sim, shard_set: ShardSet, target, stats, health, config) -> dict:
    slots = sim.activation_slots()
    g = sim.graph
    t0 = time.perf_counter()
    lib = library_bytes(fp32_slot_functions(sim, slots), target, g.module)
    stats["compile_s"] = time.perf_counter() - t0
    weights = [g.params[p.name] for p in g.weight_params]
    shard_set.call("start_fp32", lib, [v.name for v in g.inputs], weights)
    specs = [sim.plan.specs[s] for s in slots]
    ranges: list = [None] * len(slots)
    if any(o is not None for o in fp32_observers(specs, None)):
        first = _merge_passes(
            fp32_observers(specs, None), shard_set.call("fp32_states", specs, None)
        )
        ranges = [None if o is None else o.data_range() for o in first]
    merged = _merge_passes(
        fp32_observers(specs, ranges), shard_set.call("fp32_states", specs, ranges)
    )
    result = {
        s: checked_result(o.compute(sp), sp.calibrator, s)
        for s, o, sp in zip(slots, merged, specs, strict=True)
    }
    cut_ranges(sim, result, config)
    qps = [result[s] for s in slots]  # the chosen scales against the values they represent
    checks = [HealthCheck(q).observer() for q in qps]
    checks = _merge_passes(checks, shard_set.call("fp32_health_states", qps))
    health.update({s: o.compute() for s, o in zip(slots, checks, strict=True)})
    return result


def _merge_passes(observers: list, shard_states: list[list]) -> list:
    """Each slot's observer with every shard's state of it merged in (shard order)."""
    for states in shard_states:
        for obs, st in zip(observers, states, strict=True):
            if obs is not None:
                obs.merge_state(st)
    return observers
