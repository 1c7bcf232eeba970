"""How the ``autoq`` command ends when interrupted: one line, ``autoq: interrupted``, and
exit code 130 (SIGINT) or 143 (SIGTERM), whenever it happens.

* **Start-up.** Importing autoq (TVM, numpy) takes seconds; a Ctrl-C then would print an
  import traceback. When the running program is the ``autoq`` console script,
  :func:`quiet_startup` (called first thing by ``autoq/__init__``) installs handlers that
  print the line and exit at once: nothing has been written yet, nothing to clean up.
* **Running.** :func:`cleanup_on_signals` (the command's ``main``) restores Python's Ctrl-C
  (KeyboardInterrupt) and makes SIGTERM raise :class:`Terminated`, a KeyboardInterrupt, so
  every ``finally`` runs: spill files of the value cache are removed, the staged output
  folder is deleted. ``main`` prints the same line.

A library user's process is left alone (no handler installed outside the command).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

__all__ = ["Terminated", "cleanup_on_signals", "exit_code", "quiet_startup"]

MESSAGE = "autoq: interrupted"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command was, so that clean-up runs."""


def _exit_now(signum, frame):  # pragma: no cover (runs in the start-up window)
    sys.stderr.write(MESSAGE + "\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def quiet_startup() -> None:
    """In the ``autoq`` console script only: a signal during start-up exits with one line."""
    if Path(sys.argv[0]).name == "autoq":
        signal.signal(signal.SIGINT, _exit_now)
        signal.signal(signal.SIGTERM, _exit_now)


def _terminate(signum, frame):
    raise Terminated()


def cleanup_on_signals() -> None:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM :class:`Terminated` (main thread only)."""
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (an embedding application): leave as is
        pass


def exit_code(e: KeyboardInterrupt) -> int:
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
