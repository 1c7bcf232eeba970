"""Statistics a worker is still computing: resolved once, when the coordinator merges them.

Calibration's coordinator loop (:func:`autoq.calibration.run_plan`) merges observers from
every shard; a shard that runs elsewhere (a thread of :class:`autoq.calibration.shard_runner.
ShardRunner`, a Dask worker of :mod:`autoq.distributed`) hands back a pending one, and the
loop waits for it only when it merges. A cluster error (worker gone, connection lost) is a
:class:`ShardLostError` naming the shard, never a silently missing statistic. This module
imports no cluster library: it only calls the futures' ``result``.
"""

from __future__ import annotations

from collections.abc import Callable

from autoq.errors import AutoqError

__all__ = [
    "LostCall",
    "PendingObserver",
    "PendingResult",
    "ShardLostError",
    "is_lost",
    "lost_error",
    "result_of",
]


class ShardLostError(AutoqError, RuntimeError):
    """A shard's worker died or could not be reached (and no restart was left, or possible):
    the run cannot go on without its samples (a fault of the cluster, not a bug of autoq:
    the command line reports it in one line)."""


def is_lost(e: BaseException) -> bool:
    """An error of the cluster (worker gone, connection closed, cancelled), not of the
    code that ran in the worker (a missing file there is an OSError too: not lost)."""
    mod = type(e).__module__ or ""
    return (
        mod.startswith(("distributed", "tornado"))
        or (isinstance(e, OSError) and "Actor's worker" in str(e))  # dask's actor proxy
        # the scheduler's answer for an actor whose worker died (dask's actor handle raises
        # it too when a method is called on it)
        or (isinstance(e, RuntimeError) and "Worker holding Actor was lost" in str(e))
        or type(e).__name__ in ("CancelledError", "FutureCancelledError", "KilledWorker")
    )


def lost_error(e: BaseException, shard: str, what: str) -> ShardLostError:
    """The :class:`ShardLostError` for the cluster error ``e`` of ``shard`` during ``what``."""
    return ShardLostError(
        f"{shard} was lost during {what}: its worker died or became unreachable "
        f"({type(e).__name__}: {str(e)[:200]}). Calibration stops rather than go on "
        "without its samples; restart the run (check the worker's memory: "
        "Resources.memory_budget_mb is per shard)"
    )


def result_of(future, shard: str, what: str, timeout: float | None = None):
    """``future.result()``, an error of the cluster re-raised as :class:`ShardLostError`
    naming ``shard`` and the call."""
    try:
        return future.result(timeout=timeout)
    except Exception as e:
        if is_lost(e):
            raise lost_error(e, shard, what) from e
        raise


class LostCall:
    """A call that could not even be started on a shard's actor (its worker is gone): a
    future whose ``result`` raises ``error``, so the caller recovers from it like from a
    loss while the call ran."""

    def __init__(self, error: ShardLostError):
        self.error = error

    def result(self, timeout: float | None = None):
        raise self.error


class PendingResult:
    """A statistic a worker is still computing (``RemoteShard.feed``): ``resolve()`` fetches
    it once, when the coordinator merges it. ``again(error)``: fetch it from a restarted
    shard when the worker was lost (None: the :class:`ShardLostError` propagates)."""

    def __init__(self, future, shard: str, what: str, again=None):
        self._future, self.shard, self.what, self._again = future, shard, what, again
        self._value = None

    def _fetch(self):
        try:
            return result_of(self._future, self.shard, self.what)
        except ShardLostError as e:
            if self._again is None:
                raise
            return self._again(e)

    def resolve(self):
        if self._value is None:
            self._value = self._fetch()
        return self._value


class PendingObserver(PendingResult):
    """An observer whose state a worker is still computing; ``make()`` creates the empty
    observer of the same calibrator, axis and data range that the state merges into."""

    def __init__(self, future, make: Callable[[], object], shard: str, what: str, again=None):
        super().__init__(future, shard, what, again)
        self._make = make

    def resolve(self):
        """The local observer holding the shard's statistics (fetched once)."""
        if self._value is None:
            obs = self._make()
            obs.merge_state(self._fetch())
            self._value = obs
        return self._value

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
