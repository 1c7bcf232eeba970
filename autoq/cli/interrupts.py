"""How the ``autoq`` command ends when interrupted: one line, ``autoq: interrupted``, and
exit code 130 (SIGINT) or 143 (SIGTERM), whenever it happens.

* **Start-up.** Importing autoq imports nothing heavy; the command's ``main`` installs the
  handlers below before it builds its parser, and TVM is imported inside them.
* **Running.** :func:`cleanup_on_signals` (the command's ``main``) restores Python's Ctrl-C
  (KeyboardInterrupt) and makes SIGTERM raise :class:`Terminated`, a KeyboardInterrupt, so
  every ``finally`` runs: spill files of the value cache are removed, the staged output
  folder is deleted. ``main`` prints the same line.
* **Inside TVM.** A KeyboardInterrupt raised in a Python callback that TVM's C++ code called
  (a pass of the compile pipeline) comes back out of TVM as another exception (a
  ``RuntimeError``): the handlers also record the signal (:func:`received`), and ``main``
  reports any failure after a signal as the interrupt it was.

A library user's process is left alone (no handler installed outside the command).
"""

from __future__ import annotations

import signal

__all__ = ["Terminated", "cleanup_on_signals", "exit_code", "received"]

MESSAGE = "autoq: interrupted"
_received: list[int] = []


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command was, so that clean-up runs."""


def _terminate(signum, frame):
    _received.append(signum)
    raise Terminated()


def _interrupt(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt()


def cleanup_on_signals() -> None:
    """Ctrl-C raises KeyboardInterrupt and SIGTERM :class:`Terminated` (main thread only),
    each recorded for :func:`received`."""
    _received.clear()
    try:
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (an embedding application): leave as is
        pass


def received() -> KeyboardInterrupt | None:
    """The interrupt a signal caught by :func:`cleanup_on_signals` raised, if any came."""
    if not _received:
        return None
    return Terminated() if _received[0] == signal.SIGTERM else KeyboardInterrupt()


def exit_code(e: KeyboardInterrupt) -> int:
    return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
