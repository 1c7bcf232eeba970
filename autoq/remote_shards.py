"""The coordinator's view of a shard that lives in a Dask worker.

:class:`RemoteShard` has the interface of :class:`autoq.shard_runner.ShardRunner` that
:func:`autoq.calibrate.run_plan` uses (``n``, ``range_observer``, ``observer``,
``run_segment``; ``feed``, ``update_static`` for weight tuning), so the coordinator loop is
the same code in-process and distributed. Calls do not block: ``run_segment`` and
``update_static`` submit their work and return; ``observer`` (``feed``) submits the
statistics request (after the shard's previous run has finished) and returns a
:class:`PendingObserver` (:class:`PendingResult`), which fetches the state only when the
coordinator merges it. All shards therefore work at the same time, and the coordinator
waits once per slot.

A call that fails because the worker holding the shard died (or its connection was lost)
raises :class:`ShardLostError` naming the shard and its samples: a shard's samples are
never silently left out of the statistics. Errors raised by autoq itself in the worker
(bad data, ...) propagate unchanged. This module does not import Dask: it only calls the
methods of the actor handle and of the futures it returns.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["PendingObserver", "PendingResult", "RemoteShard", "ShardLostError", "result_of"]


class ShardLostError(RuntimeError):
    """A shard's worker died or could not be reached: the run cannot go on without its
    samples (start a new run; the other shards' work is not reused)."""


def _is_lost(e: BaseException) -> bool:
    """An error of the cluster (worker gone, connection closed, cancelled), not of the
    code that ran in the worker (a missing file there is an OSError too: not lost)."""
    mod = type(e).__module__ or ""
    return (
        mod.startswith(("distributed", "tornado"))
        or (isinstance(e, OSError) and "Actor's worker" in str(e))  # dask's actor proxy
        or type(e).__name__ in ("CancelledError", "FutureCancelledError", "KilledWorker")
    )


def result_of(future, shard: str, what: str, timeout: float | None = None):
    """``future.result()``, an error of the cluster re-raised as :class:`ShardLostError`
    naming ``shard`` and the call."""
    try:
        return future.result(timeout=timeout)
    except Exception as e:
        if _is_lost(e):
            raise ShardLostError(
                f"{shard} was lost during {what}: its worker died or became unreachable "
                f"({type(e).__name__}: {str(e)[:200]}). Calibration stops rather than go on "
                "without its samples; restart the run (check the worker's memory: "
                "Config.memory_budget_mb is per shard)"
            ) from e
        raise


class PendingObserver:
    """An observer whose state a worker is still computing; ``make()`` creates the empty
    observer of the same calibrator, axis and data range that the state merges into."""

    def __init__(self, future, make: Callable[[], object], shard: str, what: str):
        self._future, self._make, self.shard, self.what = future, make, shard, what
        self._obs = None

    def resolve(self):
        """The local observer holding the shard's statistics (fetched once)."""
        if self._obs is None:
            obs = self._make()
            obs.merge_state(result_of(self._future, self.shard, self.what))
            self._obs = obs
        return self._obs

    def state(self) -> dict:
        return self.resolve().state()

    def merge(self, other) -> None:
        self.resolve().merge_state(other.state())

    def merge_state(self, state: dict) -> None:
        self.resolve().merge_state(state)

    def compute(self, *spec):
        return self.resolve().compute(*spec)

    def data_range(self):
        return self.resolve().data_range()


class PendingResult:
    """A statistic a worker is still filling (``RemoteShard.feed``): ``resolve()`` fetches it
    once, when the coordinator merges it."""

    def __init__(self, future, shard: str, what: str):
        self._future, self.shard, self.what = future, shard, what
        self._value = None

    def resolve(self):
        if self._value is None:
            self._value = result_of(self._future, self.shard, self.what)
        return self._value


class RemoteShard:
    """One shard actor seen from the coordinator (see the module docstring). ``actor``: the
    Dask actor handle of an :class:`autoq.shard_actor.ShardActor`; ``name``: its shard;
    ``n``: the samples it holds; ``samples``: how they were chosen (for messages)."""

    def __init__(self, actor, name: str, n: int, samples: str = ""):
        self.actor, self.name, self.n, self.samples = actor, name, n, samples
        self._pending = None  # (future, what) of the last run_segment
        self.segment_s = 0.0

    @property
    def label(self) -> str:
        return f"{self.name} ({self.samples})" if self.samples else self.name

    def wait(self) -> None:
        """Block until the last submitted segment run has finished (its errors raised)."""
        if self._pending is not None:
            future, what = self._pending
            self._pending = None
            self.segment_s += result_of(future, self.label, what)

    def range_observer(self, slot: str) -> PendingObserver:
        from . import calibrators

        self.wait()
        fut = self.actor.range_state(slot)
        return PendingObserver(
            fut, lambda: calibrators.range_observer(None), self.label, f"the range of {slot}"
        )

    def observer(self, slot: str, calibrator, data_range=None) -> PendingObserver:
        self.wait()
        fut = self.actor.observer_state(slot, calibrator, data_range)
        return PendingObserver(
            fut,
            lambda: calibrator.observer(axis=None, data_range=data_range),
            self.label,
            f"the statistics of {slot}",
        )

    def feed(self, slot: str, sink) -> PendingResult:
        """``sink`` fed ``slot``'s input on the shard's samples, computed in the worker."""
        self.wait()
        return PendingResult(self.actor.feed(slot, sink), self.label, f"the sums of {slot}")

    def update_static(self, values: dict) -> None:
        """Submit tuned weight inputs (key -> array); the shard's next call waits for it."""
        self.wait()
        self._pending = (self.actor.update_static(values), "updating the tuned weights")

    def run_segment(self, j: int, qparams: dict, progress=None, tables=None) -> None:
        """Submit segment ``j`` (its errors surface at the next call, or :meth:`wait`);
        ``progress`` is called once per sample as it is submitted."""
        self.wait()
        fut = self.actor.run_segment(j, qparams, tables)
        self._pending = (fut, f"segment {j}")
        if progress is not None:
            for _ in range(self.n):
                progress()
