"""The coordinator's view of a shard that lives in a Dask worker.

:class:`RemoteShard` has the interface of :class:`autoq.calibration.shard_runner.ShardRunner` that
:func:`autoq.calibration.run_plan` uses (``n``, ``range_observer``, ``observer``,
``run_segment``; ``feed``, ``update_static`` for weight tuning), so the coordinator loop is
the same code in-process and distributed. Calls do not block: ``run_segment`` and
``update_static`` submit their work and return; ``observer`` (``feed``) submits the
statistics request (after the shard's previous run has finished) and returns a
:class:`PendingObserver` (:class:`PendingResult`), which fetches the state only when the
coordinator merges it. All shards therefore work at the same time, and the coordinator
waits once per slot.

A call that fails because the worker holding the shard died (or its connection was lost)
restarts the shard on another worker, at most ``Distributed.retries`` times: a new actor
reloads the shard's samples and replays the calls that changed the shard's state (its start
and every segment run so far, with the qparams and tuned weights sent then), so it holds the
same cached activations bit for bit, and the request is asked again (with a warning naming
the shard). With no retry left the run fails with :class:`ShardLostError` naming the shard
and its samples: a shard's samples are never silently left out of the statistics. Errors raised by autoq itself in the worker
(bad data, ...) propagate unchanged. This module does not import Dask: it only calls the
methods of the actor handle and of the futures it returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from autoq.calibration.pending import (
    LostCall,
    PendingObserver,
    PendingResult,
    ShardLostError,
    is_lost,
    lost_error,
    result_of,
)

__all__ = ["RemoteShard"]


class RemoteShard:
    """One shard actor seen from the coordinator (see the module docstring). ``actor``: the
    Dask actor handle of an :class:`autoq.distributed.shard_actor.ShardActor`; ``name``: its shard;
    ``n``: the samples it holds; ``samples``: how they were chosen (for messages).
    ``restart()``: a new actor holding the shard's samples on another worker (None: a lost
    worker fails the run); ``retries``: how many times it may be called."""

    def __init__(
        self,
        actor,
        name: str,
        n: int,
        samples: str = "",
        restart: Callable[[], object] | None = None,
        retries: int = 0,
    ):
        self.actor, self.name, self.n, self.samples = actor, name, n, samples
        self.restart, self.retries, self.restarts = restart, retries, 0
        self._pending = None  # (future, what) of the last state-changing call
        #: the state-changing calls so far, in order: what a restarted shard replays
        self.log: list[tuple[str, tuple, str]] = []
        self.segment_s = 0.0

    @property
    def label(self) -> str:
        return f"{self.name} ({self.samples})" if self.samples else self.name

    def submit(self, method: str, *args, what: str) -> None:
        """Call ``method(*args)`` on the actor without waiting (after the previous call);
        it changes the shard's state, so it is logged for a restart."""
        self.wait()
        self.log.append((method, args, what))
        self._pending = (self._start(method, args, what), what)

    def _start(self, method: str, args: tuple, what: str):
        """The future of ``method(*args)`` on the actor; a :class:`LostCall` when the call
        cannot start because the actor's worker is gone (dask's handle raises then)."""
        try:
            return getattr(self.actor, method)(*args)
        except Exception as e:
            if is_lost(e):
                return LostCall(lost_error(e, self.label, what))
            raise

    def wait(self) -> None:
        """Block until the last submitted call has finished (its errors raised; a lost
        worker restarts the shard, see :meth:`recover`)."""
        if self._pending is not None:
            future, what = self._pending
            self._pending = None
            try:
                self.segment_s += result_of(future, self.label, what)
            except ShardLostError as e:
                self.recover(e)  # replays every logged call, this one included

    def recover(self, error: ShardLostError) -> None:
        """Restart the shard on another worker and replay its logged calls (the segments
        run so far with the qparams chosen then, the tuned weights): the new actor holds
        what the lost one held, bit for bit. Raises ``error`` when no retry is left."""
        while True:
            if self.restart is None or self.restarts >= self.retries:
                if self.restarts:
                    raise ShardLostError(f"{error} (after {self.restarts} restart(s))") from error
                raise error
            self.restarts += 1
            warnings.warn(
                f"{self.label}: its worker was lost ({str(error)[:160]}); restarting the shard "
                f"on another worker (attempt {self.restarts} of {self.retries}): reloading its "
                f"samples, replaying {len(self.log)} step(s)",
                stacklevel=2,
            )
            try:
                self.actor = self.restart()
                for method, args, what in self.log:
                    replay = f"replay: {what}"
                    result_of(self._start(method, args, replay), self.label, replay)
                return
            except ShardLostError as e:
                error = e

    def _ask(self, method: str, *args, what: str, make=None) -> PendingResult:
        """A statistics request (no state change): pending, fetched again from a restarted
        shard if the worker is lost."""
        self.wait()

        def again(error: ShardLostError):
            self.recover(error)
            return result_of(self._start(method, args, what), self.label, what)

        fut = self._start(method, args, what)
        if make is None:
            return PendingResult(fut, self.label, what, again)
        return PendingObserver(fut, make, self.label, what, again)

    def range_observer(self, slot: str) -> PendingObserver:
        from autoq import calibrators

        def make():
            return calibrators.range_observer(None)

        return self._ask("range_state", slot, what=f"the range of {slot}", make=make)

    def observer(self, slot: str, calibrator, data_range=None) -> PendingObserver:
        def make():
            return calibrator.observer(axis=None, data_range=data_range)

        what = f"the statistics of {slot}"
        return self._ask("observer_state", slot, calibrator, data_range, what=what, make=make)

    def observe_later(self, slot: str, calibrator, data_range=None) -> PendingObserver:
        """:meth:`observer` (which does not block either)."""
        return self.observer(slot, calibrator, data_range)

    def observe_ahead(self, slot: str, calibrator) -> None:
        """None: a remote shard answers statistics requests in order, after the segment
        runs submitted before them, so statistics of values not produced yet are asked
        for when the slot's qparams are chosen."""
        return None

    def feed(self, slot: str, sink, spare=None) -> PendingResult:
        """``sink`` fed ``slot``'s input on the shard's samples, computed in the worker
        (``spare`` is not used: the shards already work at the same time)."""
        return self._ask("feed", slot, sink, what=f"the sums of {slot}")

    def update_static(self, values: dict) -> None:
        """Submit tuned weight inputs (key -> array); the shard's next call waits for it."""
        self.submit("update_static", values, what="updating the tuned weights")

    def run_segment(self, j: int, qparams: dict, progress=None, tables=None) -> None:
        """Submit segment ``j`` (its errors surface at the next call, or :meth:`wait`);
        ``progress`` is called once per sample as it is submitted."""
        self.submit("run_segment", j, qparams, tables, what=f"segment {j}")
        if progress is not None:
            for _ in range(self.n):
                progress()
