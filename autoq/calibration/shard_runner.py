"""The per-sample half of topological calibration: one shard of the samples.

Calibration is split into a coordinator (:func:`autoq.calibration.calibrate`: picks every
slot's qparams, in topological order) and :class:`ShardRunner` objects that hold the
samples, the compiled segments and the cached activations, and answer two kinds of
request: "your statistics of slot ``s``" (an observer over the shard's cached input of that
slot's quantize) and "run segment ``j`` with these qparams". In-process there is one runner
holding the whole dataset; a distributed run gives every worker one runner for its shard
and merges their observers (exactly: see :mod:`autoq.calibrators`), so the qparams are the
same bit for bit whatever the number of shards. Everything a runner is given is plain data
(:class:`autoq.calibration.plan.CalibrationPlan`, numpy arrays) plus the compiled VM.

A runner uses more threads than the VM's (numpy, BLAS and VM calls release the GIL): with
a ``twin`` VM the odd samples of each segment run on it at the same time, each VM on one TVM
thread (:func:`autoq.threads.one_thread`; a pool of every core per VM oversubscribes them),
and worker threads
take the observers asked for ahead or later (:meth:`ShardRunner.observe_ahead`,
:meth:`ShardRunner.observe_later`), half of a feed (:meth:`ShardRunner.feed`) and the copy
of each sample's segment outputs into the cache. The results are the same bits as on one
thread (each sample runs the same code; observers and feeds merge exactly).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, ThreadPoolExecutor

import numpy as np
import tvm

from autoq import calibrators
from autoq.calibration.pending import PendingObserver
from autoq.calibration.plan import CalibrationPlan
from autoq.calibration.value_cache import ValueCache
from autoq.ir.toolkit import as_list
from autoq.threads import one_thread

__all__ = ["COPIES_IN_FLIGHT", "LaterObserver", "ShardRunner", "observe_ahead"]

#: samples whose segment outputs may wait for their copy into the cache (each keeps the
#: VM memory they live in) while the VM runs the next sample
COPIES_IN_FLIGHT = 2


class ShardRunner:
    """Runs the plan's segments over one shard of samples (see the module docstring).

    ``vm``: the compiled plan (``prologue`` and one function per segment). ``static``:
    key -> array for every weight and weight qparam input. ``budget_bytes``/``cache_dir``:
    the shard's :class:`ValueCache`. ``twin``: another VM over the same executable
    (:func:`autoq.ir.toolkit.compile_vms`): segments then run the odd samples on it, on a
    thread of their own, while ``vm`` runs the even ones."""

    def __init__(
        self,
        vm,
        plan: CalibrationPlan,
        static: dict[int, np.ndarray],
        budget_bytes: float,
        cache_dir: str | None = None,
        twin=None,
    ):
        self.vm, self.plan, self.twin = vm, plan, twin
        # (np.ascontiguousarray would turn a 0-d scale into 1-d)
        self.static = {k: tvm.runtime.tensor(np.array(v, order="C")) for k, v in static.items()}
        self.cache = ValueCache(budget_bytes, cache_dir)
        self.n = 0

        #: observe_later_cpu_s: CPU seconds of the observers filled on the worker thread
        self.stats = {"run_s": 0.0, "observe_s": 0.0, "observe_later_cpu_s": 0.0}
        self._worker: ThreadPoolExecutor | None = None  # see _pool
        self._produced = threading.Condition()  # notified as run_segment caches values
        self._copier: ThreadPoolExecutor | None = None  # run_segment's output copies
        self._second: ThreadPoolExecutor | None = None  # run_segment's twin samples

    def load(self, samples: Iterable[dict]) -> int:
        """Cache the shard's samples (``{input name: array}``) after those loaded before;
        returns how many the shard holds."""
        for sample in samples:
            for name, key in self.plan.inputs:
                self.cache.put((key, self.n), sample[name])

            self.n += 1
        self.stats["samples"] = self.n
        return self.n

    def run_prologue(self, changed=None) -> None:
        """Compute the weight-only values (the same on every shard): every part of the
        prologue, or those reading one of the ``changed`` keys."""
        for part in self.plan.prologue:
            if changed is not None and changed.isdisjoint(part.inputs):
                continue
            outs = as_list(self.vm[part.name](*[self.static[k] for k in part.inputs]))
            self.static.update(zip(part.outputs, outs, strict=True))

    def _inputs(self, slot: str, ahead: bool = False) -> list[tuple]:
        """``slot``'s input on each sample as it is cached now (``ahead``: its cache key
        instead where it is not produced yet, see :meth:`observe_ahead`)."""
        key = self.plan.head_tensor[slot]
        out = []
        for i in range(self.n):
            k = (key, i)
            out.append(k if ahead and k not in self.cache else self.cache.get_numpy(k))
        return out

    def _batches(self, slot: str, inputs=None):
        """``slot``'s input on each sample (``inputs``: :meth:`_inputs` taken before; a
        cache key in it is waited for)."""
        for x in self._inputs(slot) if inputs is None else inputs:
            yield self._produced_value(x) if isinstance(x, tuple) else x

    def _produced_value(self, key: tuple) -> np.ndarray:
        """The cached value of ``key``, once a segment run has produced it (worker side)."""
        with self._produced:
            while key not in self.cache:
                if self._worker is None:
                    raise RuntimeError(f"runner closed before {key} was produced")
                self._produced.wait(1.0)
            return self.cache.get_numpy(key)

    def range_observer(self, slot: str):
        """The min/max observer of ``slot``'s input on this shard (histogram calibrators'
        first pass)."""
        return self.observer(slot, None)

    def observer(self, slot: str, calibrator, data_range=None):
        """``calibrator``'s observer of ``slot``'s input over this shard (None: the range
        observer)."""
        t0 = time.perf_counter()
        obs = self._observe(self._inputs(slot), slot, calibrator, data_range)
        self.stats["observe_s"] += time.perf_counter() - t0
        return obs

    def observe_later(self, slot: str, calibrator, data_range=None) -> LaterObserver:
        """:meth:`observer`, computed on the runner's worker thread while the caller goes
        on (numpy releases the GIL: it overlaps weight tuning and segment runs, which
        leave a core idle much of the time). The values are taken from the cache now:
        segments run later may drop them from the cache (their memory then stays held
        until the observer is done, outside the cache's budget: resolve it soon)."""
        return self._later(self._inputs(slot), slot, calibrator, data_range)

    def observe_ahead(self, slot: str, calibrator) -> LaterObserver:
        """:meth:`observe_later` of a slot whose input the next segment runs produce: the
        worker thread observes each sample's value as soon as :meth:`run_segment` has
        cached it, during the run. Resolve it only once those segments have run (before
        the segment reading the slot: its values are then still cached)."""
        return self._later(self._inputs(slot, ahead=True), slot, calibrator, None)

    def _pool(self) -> ThreadPoolExecutor:
        """The worker threads: two, so that a half-feed (:meth:`feed`) does not wait behind
        the observers queued before it."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(2, thread_name_prefix="autoq-observe")
        return self._worker

    def _later(self, inputs: list, slot: str, calibrator, data_range) -> LaterObserver:

        def work():  # (its CPU time: the wall time includes waiting for values)
            t0 = time.thread_time()
            obs = self._observe(inputs, slot, calibrator, data_range)
            self.stats["observe_later_cpu_s"] += time.thread_time() - t0
            return obs

        return LaterObserver(self._pool().submit(work))

    def _observe(self, inputs: list, slot: str, calibrator, data_range):
        axis = self.plan.axes.get(slot)  # per-channel lookup inputs (autoq.rules.lut_channels)
        if calibrator is None:
            obs = calibrators.range_observer(axis)
        else:
            obs = calibrator.observer(axis=axis, data_range=data_range)
        for x in self._batches(slot, inputs):
            obs.update(np.asarray(x))
        return obs

    def feed(self, slot: str, sink, spare=None):
        """Feed ``slot``'s input on every sample of this shard to ``sink.update`` (any
        mergeable statistic, e.g. the Hessians of :mod:`autoq.accuracy.weight_tuning`); returns it.
        ``spare``: an empty statistic of the same kind whose merge does not depend on how
        the samples are split (exact sums): the worker thread feeds it half of the samples
        meanwhile (numpy and BLAS release the GIL) and calls its ``flush()`` if it has one
        (sums it buffered are computed there too), then it is merged into ``sink``."""
        t0 = time.perf_counter()
        inputs = self._inputs(slot)
        half = None
        if spare is not None and len(inputs) > 1:
            inputs, rest = inputs[: len(inputs) // 2], inputs[len(inputs) // 2 :]
            half = self._pool().submit(self._feed, slot, rest, spare, True)
        self._feed(slot, inputs, sink)
        if half is not None:
            sink.merge(half.result())
        self.stats["observe_s"] += time.perf_counter() - t0
        return sink

    def _feed(self, slot: str, inputs: list, sink, flush: bool = False):
        for x in self._batches(slot, inputs):
            sink.update(np.asarray(x))
        if flush and hasattr(sink, "flush"):
            sink.flush()
        return sink

    def update_static(self, values: dict[int, np.ndarray]) -> None:
        """Replace weight / weight-qparam inputs (key -> array) chosen by calibration and
        recompute the parts of the prologue that read them."""
        for k, v in values.items():
            self.static[k] = tvm.runtime.tensor(np.array(v, order="C"))
        self.run_prologue(set(values))

    def run_segment(
        self,
        j: int,
        qparams: dict[str, tuple],
        progress: Callable[[], None] | None = None,
        tables: dict[str, np.ndarray] | None = None,
    ) -> None:
        """Run segment ``j`` on every sample with its heads' ``qparams`` (slot -> (scale,
        zero point)) and the lookup ``tables`` (layer -> table) they determine, cache what
        later segments read, free what they do not."""
        seg = self.plan.segments[j]
        for sid, (scale, zp) in qparams.items():
            s_key, z_key = self.plan.qparam_keys[sid]
            self.static[s_key] = tvm.runtime.tensor(np.asarray(scale, np.float32))
            self.static[z_key] = tvm.runtime.tensor(np.asarray(zp, np.int32))
        for layer, table in (tables or {}).items():
            self.static[self.plan.table_keys[layer]] = tvm.runtime.tensor(table)
        t0 = time.perf_counter()
        if self._copier is None:  # one thread: the only one that writes to the cache
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="autoq-cache")
            self._second = ThreadPoolExecutor(1, thread_name_prefix="autoq-twin")
        odd = None
        if self.twin is not None and self.n > 1:  # the odd samples on the twin, meanwhile
            odd = self._second.submit(self._run_twin, seg, range(1, self.n, 2))
        try:  # two VMs at once: one TVM thread each, not a pool of all cores each
            with one_thread(odd is not None):
                done = self._run_samples(self.vm, seg, range(0, self.n, 1 + (odd is not None)))
        finally:  # the twin's samples are done (their error raised) before returning
            done_odd = 0 if odd is None else odd.result()
        for _ in range(done + done_odd if progress is not None else 0):
            progress()
        self.stats["run_s"] += time.perf_counter() - t0
        for k in seg.drop:
            for i in range(self.n):
                self.cache.drop((k, i))

    def _run_twin(self, seg, samples: range) -> int:
        """:meth:`_run_samples` on the twin VM, on one TVM thread (its own thread's pool)."""
        with one_thread():
            return self._run_samples(self.twin, seg, samples)

    def _run_samples(self, vm, seg, samples: range) -> int:
        """Run ``seg`` on ``vm`` for ``samples``; each sample's outputs are copied into the
        cache on the copier thread while ``vm`` runs the next sample (at most
        :data:`COPIES_IN_FLIGHT` waiting, each holding its VM memory); every value is cached
        (or the copy's error raised) before it returns the number of samples run."""
        f = vm[seg.name]
        copies: list = []
        try:
            for i in samples:
                args = [
                    self.static[k] if k in self.static else self.cache.get((k, i))
                    for k in seg.inputs
                ]
                outs = as_list(f(*args))
                if len(copies) >= COPIES_IN_FLIGHT:
                    copies.pop(0).result()
                copies.append(self._copier.submit(self._cache_outputs, seg.outputs, i, outs))
        finally:
            for c in copies:
                c.result()
        return len(samples)

    def _cache_outputs(self, keys: list, i: int, outs: list) -> None:
        """Copy sample ``i``'s segment outputs into the cache (on the copier thread, while
        the VM runs the next sample: the copy releases the GIL) and wake the observers
        waiting for them (:meth:`observe_ahead`)."""
        for k, o in zip(keys, outs, strict=True):
            self.cache.put((k, i), o)
        if self._worker is not None:
            with self._produced:
                self._produced.notify_all()

    def cache_stats(self) -> dict[str, float]:
        return {
            "cache_peak_mb": self.cache.peak / 2**20,
            "spilled_mb": self.cache.spilled / 2**20,
        }

    def close(self) -> None:
        if self._copier is not None:
            self._second.shutdown(wait=True)
            self._copier.shutdown(wait=True)
            self._copier = self._second = None
        worker, self._worker = self._worker, None
        if worker is not None:
            with self._produced:  # (an observer still waiting for a value gives up)
                self._produced.notify_all()
            worker.shutdown(wait=True, cancel_futures=True)
        self.cache.close()


class LaterObserver(PendingObserver):
    """An observer that a runner's worker thread is still filling
    (:meth:`ShardRunner.observe_later`): waited for when it is merged or computed (an
    error in the worker is raised then)."""

    def __init__(self, future):
        super().__init__(future, make=None, shard="", what="")

    def resolve(self):
        try:
            return self._future.result()
        except CancelledError:
            raise RuntimeError("runner closed before the observer ran") from None


def observe_ahead(runners: list, heads, specs: dict, fixed) -> dict[str, list]:
    """slot -> its shards' observers, for the ``heads`` of the segment after the one about
    to run, filled by each runner while that segment runs (:meth:`ShardRunner.observe_ahead`);
    left out: ``fixed`` slots, calibrators that need a range pass first and runners that
    cannot (remote shards: their statistics are asked for when the qparams are chosen)."""
    out = {}
    for sid in heads:
        cal = specs[sid].calibrator
        if sid in fixed or getattr(cal, "needs_range", False):
            continue
        observers = [r.observe_ahead(sid, cal) for r in runners]
        if all(o is not None for o in observers):
            out[sid] = observers
    return out
