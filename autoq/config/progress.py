"""Live progress on standard error, one helper for every stage: a bar (:func:`bar`, tqdm)
where a stage counts steps (patterns, samples, layers) and a one-line status with the
elapsed time (:func:`status`, redrawn from a daemon thread) for a stage that is one opaque
call (a TVM compile). While a bar is open the status is paused (the two share the line).

Nothing is drawn unless asked: ``show=True``, or ``show=None`` inside ``with shown(True):``
(the pipeline turns it on for its run from :attr:`autoq.config.Resources.show_progress`,
i.e. when standard error is a terminal), so piped output never gets a carriage return.

>>> with status("compile", show=False):  # off: nothing drawn, no thread
...     pass
>>> [x for x in bar(range(3), desc="match", show=False)]
[0, 1, 2]
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
import time

__all__ = ["bar", "shown", "status"]

#: whether ``show=None`` draws (set by :func:`shown`)
_SHOWN = contextvars.ContextVar("autoq_progress_shown", default=False)
#: the status line's lock, and how many bars are open (the status waits while any is)
_LOCK = threading.Lock()
_OPEN_BARS = [0]
#: the width of the status line on screen (0: none drawn)
_status_width = [0]
#: seconds between two redraws of a status line
INTERVAL_S = 0.5


@contextlib.contextmanager
def shown(show: bool):
    """``with shown(show):`` the calls with ``show=None`` draw when ``show`` is true."""
    token = _SHOWN.set(bool(show))
    try:
        yield
    finally:
        _SHOWN.reset(token)


def _wanted(show: bool | None) -> bool:
    return _SHOWN.get() if show is None else bool(show)


def bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "step", show=None):
    """A tqdm bar on standard error (``leave=False``: gone when closed), disabled unless
    ``show`` (None: as :func:`shown` says); iterate it or call ``update``/``close``."""
    tqdm = _bar_class()
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not _wanted(show):
        return tqdm(iterable, total=total, disable=True)
    with _LOCK:  # the status line gives way to the bar
        _OPEN_BARS[0] += 1
        _erase(sys.stderr, _status_width[0])
        _status_width[0] = 0
    try:
        b = tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)
    except BaseException:
        with _LOCK:
            _OPEN_BARS[0] -= 1
        raise
    b.counted = True
    return b


@functools.cache
def _bar_class():
    """tqdm whose ``close`` (also at garbage collection) lets a paused status line resume."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        counted = False  # (an open bar counted in _OPEN_BARS)

        def close(self) -> None:
            if self.counted:
                self.counted = False
                with _LOCK:
                    _OPEN_BARS[0] -= 1
            super().close()

    return Bar


def _erase(stream, width: int) -> None:
    if width:
        stream.write("\r" + " " * width + "\r")
        stream.flush()


@contextlib.contextmanager
def status(desc: str, show=None):
    """``with status("compile"):`` a line ``compile   3.5 s ...`` on standard error while
    the block runs (redrawn every ``INTERVAL_S`` by a daemon thread, paused while a
    :func:`bar` is open), erased when it ends, however it ends (Ctrl-C included)."""
    if not _wanted(show):
        yield
        return
    stream, t0, stop = sys.stderr, time.perf_counter(), threading.Event()

    def draw() -> None:
        with _LOCK:
            if _OPEN_BARS[0] or stop.is_set():
                return
            text = f"{desc:<14} {time.perf_counter() - t0:6.1f} s ..."
            stream.write("\r" + text.ljust(_status_width[0]))
            stream.flush()
            _status_width[0] = max(_status_width[0], len(text))

    def loop() -> None:
        while not stop.wait(INTERVAL_S):
            draw()

    draw()
    thread = threading.Thread(target=loop, name=f"autoq-status-{desc}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2 * INTERVAL_S)
        with _LOCK:
            _erase(stream, _status_width[0])
            _status_width[0] = 0
