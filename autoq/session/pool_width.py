"""How many threads a :class:`autoq.Session` runs its next call on.

TVM splits every parallel kernel into one fixed part per thread, so a call takes as long as
its slowest part: when another process keeps a CPU busy, the thread that shares it waits
behind that process at each kernel. Measured (ResNet-50 int8, TVM 0.27, 2-vCPU Xeon with
AMX, one busy process pinned to CPU 1, interleaved in one run): 672 ms per call on 2 threads
against 32 ms on 1; with the machine to itself, 2 threads beat 1 (4.5 against 7.1 ms at
best). No fixed width is right for both, so a session times its calls and keeps the faster
width (:class:`WidthChooser`).
"""

from __future__ import annotations

from collections import deque
from statistics import median

__all__ = ["WidthChooser"]


class WidthChooser:
    """The thread count (width) for the next call: the width whose last :attr:`KEEP` calls
    took the least wall time (median). Each width is timed :attr:`KEEP` times first, in
    turn; after that, one call in :attr:`FIRST_INTERVAL` runs on another width, and each
    time that width loses the interval doubles (up to :attr:`MAX_INTERVAL`), so a machine
    that stays busy costs one slow call in ``MAX_INTERVAL``; a win makes it the width and
    resets the interval.

    >>> c = WidthChooser((1, 2))
    >>> for _ in range(6):  # the first 6 calls: 1, 2, 1, 2, 1, 2 threads
    ...     n = c.next(); c.record(n, {1: 8.0, 2: 4.5}[n])
    >>> c.next()
    2
    >>> for _ in range(2):  # another process takes a CPU: 2 threads now take 400 ms
    ...     n = c.next(); c.record(n, {1: 9.0, 2: 400.0}[n])
    >>> c.next()
    1
    """

    KEEP = 3
    FIRST_INTERVAL = 8
    MAX_INTERVAL = 1024

    def __init__(self, widths):
        self.widths = tuple(sorted({int(w) for w in widths}))
        if not self.widths or self.widths[0] < 1:
            raise ValueError(f"WidthChooser: widths must be thread counts >= 1, got {widths}")
        self._times = {w: deque(maxlen=self.KEEP) for w in self.widths}
        self._interval = self.FIRST_INTERVAL
        self._since_probe = 0
        self._turn = 0  # which other width the next probe runs on

    def best(self) -> int:
        """The width with the lowest median of its recent calls (the smaller on a tie)."""
        return min(self.widths, key=lambda w: (median(self._times[w]), w))

    def next(self) -> int:
        """The width to run the next call on."""
        for w in self.widths:
            if len(self._times[w]) < self.KEEP and len(self._times[w]) <= min(
                len(t) for t in self._times.values()
            ):
                return w
        best = self.best()
        if len(self.widths) > 1 and self._since_probe >= self._interval:
            others = [w for w in self.widths if w != best]
            return others[self._turn % len(others)]
        return best

    def record(self, width: int, seconds: float) -> None:
        """The wall time of a call that ran on ``width`` threads."""
        times = self._times[width]
        if len(times) < self.KEEP:  # still timing each width
            times.append(seconds)
            return
        best = self.best()
        if width == best:
            times.append(seconds)
            self._since_probe += 1
            return
        self._since_probe, self._turn = 0, self._turn + 1
        if seconds < median(self._times[best]):  # the other width is faster now
            times.clear()
            times.append(seconds)
            self._interval = self.FIRST_INTERVAL
        else:
            times.append(seconds)
            self._interval = min(2 * self._interval, self.MAX_INTERVAL)
