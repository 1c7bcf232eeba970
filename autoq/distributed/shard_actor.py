"""The worker side of distributed calibration: one :class:`ShardActor` per shard of samples.

A shard actor lives in a Dask worker process (created by :mod:`autoq.distributed` as a Dask
*actor*, so its state stays in that worker between calls) and holds

* its shard's samples, read by the worker itself from a shard source
  (:mod:`autoq.dataset.shards`) or pushed by the coordinator, kept in its own
  :class:`autoq.calibration.value_cache.ValueCache` (``Resources.memory_budget_mb``, then disk);
* for topological calibration, a :class:`autoq.calibration.shard_runner.ShardRunner` over the compiled
  plan and its cached activations (the same runner in-process calibration uses);
* for fp32-mode calibration, the compiled float graph returning every slot's tensor (also
  the float graph of the layer inputs whose fp32 means empirical bias correction needs).

Everything it returns is plain data: observer *states* (``observer.state()``, numpy arrays,
see :mod:`autoq.calibrators`), counts and statistics. The compiled libraries arrive as the
bytes of an exported shared library (:func:`load_vm`), so a worker needs autoq and TVM but
no compiler, and runs exactly the code the coordinator built (same results bit for bit on
the same CPU). This module does not import Dask.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from collections.abc import Iterable

import numpy as np
import tvm
from tvm import relax

from autoq.calibration import feed_observers, fp32_observers
from autoq.calibration.plan import CalibrationPlan
from autoq.calibration.shard_runner import ShardRunner
from autoq.calibration.value_cache import ValueCache
from autoq.config import QuantSpec
from autoq.cpu.amx import request_amx
from autoq.dataset import DatasetError, InputSpec, validate_sample
from autoq.ir.run import fp32_runner
from autoq.metrics import output_sums

__all__ = ["ShardActor", "load_vm", "shard_name", "tune_malloc"]


def shard_name(i: int, n: int) -> str:
    """``"shard 2/4"`` (1-based, as in messages)."""
    return f"shard {i + 1}/{n}"


def load_vm(lib: bytes) -> relax.VirtualMachine:
    """A VM on this CPU over the bytes of an exported library (written to a temporary file
    for the loader, removed once loaded)."""
    request_amx()  # a library built for an AMX target faults without it (harmless elsewhere)
    fd, path = tempfile.mkstemp(suffix=".so", prefix="autoq-shard-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(lib)
        return relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    finally:
        os.unlink(path)


def tune_malloc() -> bool:
    """Undo the 64 KiB ``MALLOC_TRIM_THRESHOLD_`` that Dask's nanny sets for its workers:
    with that variable set, glibc keeps its mmap threshold at 128 KiB, so every numpy
    temporary of a calibrator is a fresh ``mmap`` (page faults, zeroing; measured: a
    percentile observer update on a ResNet-50 activation 3.3x slower). Fixed thresholds
    instead: allocations below 32 MiB reuse the heap, 64 MiB of free heap is returned to the
    OS. Returns whether it applied (glibc only)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(
        libc.mallopt(m_mmap_threshold, 32 * 2**20) and libc.mallopt(m_trim_threshold, 64 * 2**20)
    )


def _peak_rss_mb() -> float:
    """The process' resident-memory high-water mark: VmHWM on Linux (``ru_maxrss`` would
    include the parent's before ``exec``), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class ShardActor:
    """Shard ``index`` of ``count`` (see the module docstring). ``specs``: the model's
    inputs (samples are validated against them); ``budget_bytes``/``cache_dir``: the
    shard's memory budget and spill folder (a ``shard-<i>`` subfolder of it)."""

    def __init__(
        self,
        index: int,
        count: int,
        specs: list[InputSpec],
        budget_bytes: float,
        cache_dir: str | None = None,
    ):
        tune_malloc()
        self.index, self.count, self.specs = index, count, list(specs)
        self.name = shard_name(index, count)
        self.budget = budget_bytes
        self.cache_dir = None if cache_dir is None else os.path.join(cache_dir, f"shard-{index}")
        self.store = ValueCache(budget_bytes, self.cache_dir)
        self.n = 0
        self.runner: ShardRunner | None = None
        self.fp32 = None
        self.analysis = None

    # ---- samples
    def read(self, source) -> int:
        """Read this shard of a shard source (``source.shard(index, count)``), validating
        every sample; returns how many the shard holds."""
        try:
            return self.add(
                validate_sample(raw, self.n, self.specs)
                for raw in source.shard(self.index, self.count)
            )
        except DatasetError as e:
            raise DatasetError(f"{self.name} of {source.describe()}: {e}") from None

    def add(self, samples: Iterable[dict]) -> int:
        """Keep validated samples (``{input name: array}``) after the ones held."""
        for sample in samples:
            for s in self.specs:
                self.store.put((s.name, self.n), sample[s.name])
            self.n += 1
        return self.n

    def samples(self):
        for i in range(self.n):
            yield {s.name: self.store.get_numpy((s.name, i)) for s in self.specs}

    def info(self) -> dict:
        """pid, samples held and this worker process' peak resident memory (MB)."""
        return {"pid": os.getpid(), "samples": self.n, "peak_rss_mb": _peak_rss_mb()}

    # ---- topological calibration
    def start_topological(self, lib: bytes, plan: CalibrationPlan, static: dict) -> float:
        """Load the compiled plan, cache the samples as its inputs, run the prologue;
        returns the seconds it took."""
        t0 = time.perf_counter()
        self.close_runner()
        cache_dir = None if self.cache_dir is None else os.path.join(self.cache_dir, "plan")
        self.runner = ShardRunner(load_vm(lib), plan, static, self.budget, cache_dir)
        self.runner.load(self.samples())
        self.runner.run_prologue()
        return time.perf_counter() - t0

    def range_state(self, slot: str) -> dict:
        return self._runner().range_observer(slot).state()

    def observer_state(self, slot: str, calibrator, data_range=None) -> dict:
        return self._runner().observer(slot, calibrator, data_range).state()

    def run_segment(self, j: int, qparams: dict, tables: dict | None = None) -> float:
        """Run segment ``j`` with its heads' qparams; returns the seconds it took."""
        t0 = time.perf_counter()
        self._runner().run_segment(j, qparams, tables=tables)
        return time.perf_counter() - t0

    def feed(self, slot: str, sink):
        """``sink`` (e.g. :class:`autoq.accuracy.weight_tuning.InputStats`) fed ``slot``'s input on
        every sample of the shard, returned with its sums."""
        return self._runner().feed(slot, sink)

    def update_static(self, values: dict) -> float:
        """Replace tuned weight / bias / weight-qparam inputs and recompute the prologue;
        returns the seconds it took."""
        t0 = time.perf_counter()
        self._runner().update_static(values)
        return time.perf_counter() - t0

    def finish_topological(self) -> dict:
        """The runner's timings and cache statistics; frees its cached activations."""
        r = self._runner()
        out = {**r.stats, **r.cache_stats()}
        self.close_runner()
        return out

    def _runner(self) -> ShardRunner:
        if self.runner is None:
            raise RuntimeError(f"{self.name}: start_topological was not called")
        return self.runner

    def close_runner(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    # ---- fp32-mode calibration
    def start_fp32(self, lib: bytes, input_names: list[str], weights: list[np.ndarray]) -> None:
        """Load the float graph returning every activation slot's tensor."""
        self.fp32 = fp32_runner(load_vm(lib), input_names, weights)

    def fp32_states(self, specs: list[QuantSpec], ranges: list | None) -> list:
        """One fp32-mode pass over the shard (:func:`autoq.calibration.fp32_observers`):
        each slot's observer state (None where a slot has no observer in this pass)."""
        if self.fp32 is None:
            raise RuntimeError(f"{self.name}: start_fp32 was not called")
        observers = feed_observers(fp32_observers(specs, ranges), self.fp32(self.samples()))
        return [None if o is None else o.state() for o in observers]

    def _fp32_values(self):
        if self.fp32 is None:
            raise RuntimeError(f"{self.name}: start_fp32 was not called")
        return self.fp32(self.samples())

    def fp32_patch_sums(self, means: list[list]) -> list:
        """Per sample of the shard, per output of the float graph, per empty mean patch of
        ``means`` (:class:`autoq.accuracy.bias_correction.PatchMean`, one list per output) its
        ``sums(x)`` on the sample's fp32 value."""
        return [
            [[m.sums(x) for m in ms] for ms, x in zip(means, outs, strict=True)]
            for outs in self._fp32_values()
        ]

    def fp32_feed(self, sinks: list) -> list:
        """``sinks`` (one per output of the float graph, e.g. :class:`autoq.accuracy.bias_gate.
        HeldRows`) fed every sample's fp32 values; returned."""
        for outs in self._fp32_values():
            for sink, x in zip(sinks, outs, strict=True):
                sink.update(x)
        return sinks

    # ---- per-layer analysis and fallback trials
    def start_analysis(self, mod, params, qparams, config, target, accumulator: str) -> float:
        """Build the per-layer analysis of ``mod`` (compiled here) over this shard; returns
        the seconds it took."""
        from autoq.fallback.analysis import Analysis

        t0 = time.perf_counter()
        self.analysis = Analysis(mod, params, self.samples, qparams, config, target, accumulator)
        return time.perf_counter() - t0

    def analysis_sums(self) -> dict:
        """:meth:`autoq.fallback.analysis.Analysis.shard_sums` of the shard's analysis."""
        return self._analysis().shard_sums()

    def trial_sums(self, disabled: list[str]) -> list:
        """Per sample, the output sums (:func:`autoq.metrics.output_sums`) of the simulated
        graph with the ``disabled`` layers in fp32 against fp32."""
        an = self._analysis()
        return output_sums(an.run_fp32(), an.run(disabled))

    def _analysis(self):
        if self.analysis is None:
            raise RuntimeError(f"{self.name}: start_analysis was not called")
        return self.analysis

    def fp32_health_states(self, qparams: list) -> list:
        """The :mod:`autoq.calibration.scale_health` observer states of each slot's chosen qparams
        over the shard's fp32 values (the fp32 mode's last pass)."""
        from autoq.calibration.scale_health import HealthCheck

        checks = [HealthCheck(q).observer() for q in qparams]
        return [o.state() for o in feed_observers(checks, self.fp32(self.samples()))]

    def close(self) -> None:
        self.close_runner()
        self.fp32 = self.analysis = None
        self.store.close()
