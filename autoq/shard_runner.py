"""The per-sample half of topological calibration: one shard of the samples.

Calibration is split into a coordinator (:func:`autoq.calibrate.calibrate`: picks every
slot's qparams, in topological order) and :class:`ShardRunner` objects that hold the
samples, the compiled segments and the cached activations, and answer two kinds of
request: "your statistics of slot ``s``" (an observer over the shard's cached input of that
slot's quantize) and "run segment ``j`` with these qparams". In-process there is one runner
holding the whole dataset; a distributed run gives every worker one runner for its shard
and merges their observers (exactly: see :mod:`autoq.calibrators`), so the qparams are the
same bit for bit whatever the number of shards. Everything a runner is given is plain data
(:class:`autoq.calibration_plan.CalibrationPlan`, numpy arrays) plus the compiled VM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import tvm

from . import calibrators
from .calibration_plan import CalibrationPlan
from .token_mask import real_tokens
from .toolkit import as_list
from .value_cache import ValueCache

__all__ = ["ShardRunner"]


class ShardRunner:
    """Runs the plan's segments over one shard of samples (see the module docstring).

    ``vm``: the compiled plan (``prologue`` and one function per segment). ``static``:
    key -> array for every weight and weight qparam input. ``budget_bytes``/``cache_dir``:
    the shard's :class:`ValueCache`."""

    def __init__(
        self,
        vm,
        plan: CalibrationPlan,
        static: dict[int, np.ndarray],
        budget_bytes: float,
        cache_dir: str | None = None,
    ):
        self.vm, self.plan = vm, plan
        # (np.ascontiguousarray would turn a 0-d scale into 1-d)
        self.static = {k: tvm.runtime.tensor(np.array(v, order="C")) for k, v in static.items()}
        self.cache = ValueCache(budget_bytes, cache_dir)
        self.n = 0
        #: per sample: the bool (batch, seq) real-token mask (``plan.mask_input``)
        self.keep: list[np.ndarray] = []
        self.stats = {"run_s": 0.0, "observe_s": 0.0}

    def load(self, samples: Iterable[dict]) -> int:
        """Cache the shard's samples (``{input name: array}``) after those loaded before;
        returns how many the shard holds."""
        for sample in samples:
            for name, key in self.plan.inputs:
                self.cache.put((key, self.n), sample[name])
            if self.plan.mask_input is not None:
                self.keep.append(np.asarray(sample[self.plan.mask_input]) != 0)
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

    def _batches(self, slot: str):
        """``slot``'s input on each sample; with a token layout only its real tokens
        (samples without any left out)."""
        key = self.plan.head_tensor[slot]
        layout = self.plan.token_layouts.get(slot)
        for i in range(self.n):
            x = self.cache.get_numpy((key, i))
            if layout is not None:
                x = real_tokens(x, self.keep[i], layout)
                if x.size == 0:
                    continue
            yield x

    def range_observer(self, slot: str):
        """The min/max observer of ``slot``'s input on this shard (histogram calibrators'
        first pass)."""
        return self.observer(slot, None)

    def observer(self, slot: str, calibrator, data_range=None):
        """``calibrator``'s observer of ``slot``'s input over this shard (None: the range
        observer)."""
        t0 = time.perf_counter()
        if calibrator is None:
            obs = calibrators.range_observer(None)
        else:
            obs = calibrator.observer(axis=None, data_range=data_range)
        for x in self._batches(slot):
            obs.update(np.asarray(x))
        self.stats["observe_s"] += time.perf_counter() - t0
        return obs

    def feed(self, slot: str, sink):
        """Feed ``slot``'s input on every sample of this shard to ``sink.update`` (any
        mergeable statistic, e.g. the Hessians of :mod:`autoq.weight_tuning`); returns it."""
        t0 = time.perf_counter()
        for x in self._batches(slot):
            sink.update(np.asarray(x))
        self.stats["observe_s"] += time.perf_counter() - t0
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
        f = self.vm[seg.name]
        t0 = time.perf_counter()
        for i in range(self.n):
            args = [
                self.static[k] if k in self.static else self.cache.get((k, i)) for k in seg.inputs
            ]
            for k, o in zip(seg.outputs, as_list(f(*args)), strict=True):
                self.cache.put((k, i), o)
            if progress is not None:
                progress()
        self.stats["run_s"] += time.perf_counter() - t0
        for k in seg.drop:
            for i in range(self.n):
                self.cache.drop((k, i))

    def cache_stats(self) -> dict[str, float]:
        return {
            "cache_peak_mb": self.cache.peak / 2**20,
            "spilled_mb": self.cache.spilled / 2**20,
        }

    def close(self) -> None:
        self.cache.close()
