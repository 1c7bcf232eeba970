"""What the command prints, through :mod:`logging` (the library's logger ``autoq``).

* Standard output: the run's lines (the model, one line per stage with its time and what it
  counted, the report) at INFO; with ``-v`` also DEBUG (when each stage starts).
* Standard error: warnings (``autoq: warning: ...``); errors are printed by ``main``.
* ``--quiet``: nothing but errors.

Live progress (every stage's status line and bars, :mod:`autoq.config.progress`, standard
error) is drawn only when standard error is a terminal, so piped or redirected output has
no carriage-return redraws; ``--no-progress`` and ``--quiet`` turn it off.
"""

from __future__ import annotations

import contextlib
import logging
import sys

__all__ = ["LOGGER", "console"]

#: the logger of the library and the command
LOGGER = logging.getLogger("autoq")


class _Console(logging.Handler):
    """INFO and below to the current ``sys.stdout``, warnings to ``sys.stderr`` (looked up
    at each message, so a redirected or captured stream is honoured)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # pragma: no cover (a bad format string in a message)
            self.handleError(record)
            return
        if record.levelno >= logging.WARNING:
            print(f"autoq: {record.levelname.lower()}: {text}", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stdout, flush=True)


@contextlib.contextmanager
def console(quiet: bool = False, verbose: bool = False):
    """``with console(quiet, verbose):`` the ``autoq`` logger prints to the console at the
    level the options ask for; as it was afterwards (``main`` may run in a user's process)."""
    handler, saved = _Console(), (LOGGER.level, LOGGER.propagate)
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO)
    LOGGER.propagate = False
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(saved[0])
        LOGGER.propagate = saved[1]
