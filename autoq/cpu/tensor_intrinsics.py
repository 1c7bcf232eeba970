"""Import TVM's tensor intrinsics (``tvm.s_tir.tensor_intrin``) in seconds, not minutes.

MetaSchedule imports ``tvm.s_tir.tensor_intrin`` before it tunes (``TuneContext``), and
autoq's VNNI fix must import it before re-registering ``dot_16x4_vnni``. The package parses
~250 TVMScript functions for every target, and each ``T.prim_func`` decorator calls
``inspect.stack()``: for every frame of the caller's stack that stack builds the source
context, and for frames without a file on disk (``<frozen importlib._bootstrap>``, which
every import puts on the stack) ``inspect.getmodule`` scans all of ``sys.modules``. The
cost grows with the stack's depth times the number of loaded modules: measured on Zen 4,
23 s in a fresh ``python -c 'import autoq'`` process, 214 of a pytest tuning test's 283 s
under cProfile; the full suite's tuning tests took 425 / 345 s before this module and
100 / 53 / 25 s after.

TVMScript reads from that stack only the frames' ``frame`` objects (closure variables
hidden by PEP 563), their function names, and the source line of the third frame (class
scope detection), so :func:`import_tensor_intrinsics` gives its parser, for the duration
of the import, a ``stack()`` that fills the source context of the first
:data:`CONTEXT_FRAMES` frames exactly as :func:`inspect.stack` does and leaves it empty
(``code_context=None``, what :func:`inspect.stack` returns for frames without source) for
the others and for frames without a file. Same intrinsics, ~2 s.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading

__all__ = ["CONTEXT_FRAMES", "cheap_stack", "cheap_tvmscript_stack", "import_tensor_intrinsics"]

#: frames whose source context TVMScript may read (``is_defined_in_class`` reads the third)
CONTEXT_FRAMES = 3

_LOCK = threading.Lock()
_SWAP_LOCK = threading.RLock()  # one thread at a time within cheap_tvmscript_stack


def cheap_stack(context: int = 1, *, skip: int = 1) -> list[inspect.FrameInfo]:
    """:func:`inspect.stack` of the caller with the source context of the first
    :data:`CONTEXT_FRAMES` frames that have a file on disk; other frames carry
    ``code_context=None`` and ``index=None``.

    >>> frames = cheap_stack()
    >>> frames[0].function == "<module>" and frames[0].frame is not None
    True
    """
    frame = sys._getframe(skip)
    out: list[inspect.FrameInfo] = []
    while frame is not None:
        code = frame.f_code
        if len(out) < CONTEXT_FRAMES and os.path.exists(code.co_filename):
            out.append(inspect.FrameInfo(frame, *inspect.getframeinfo(frame, context)))
        else:
            info = (code.co_filename, frame.f_lineno, code.co_name, None, None)
            out.append(inspect.FrameInfo(frame, *info))
        frame = frame.f_back
    return out


class _InspectWithCheapStack:
    """The :mod:`inspect` module as TVMScript's ``prim_func`` sees it within :func:`cheap_tvmscript_stack`."""

    def __getattr__(self, name: str):
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        return cheap_stack(context, skip=2)


@contextlib.contextmanager
def cheap_tvmscript_stack():
    """Within the block TVMScript's ``T.prim_func`` reads the caller's stack with
    :func:`cheap_stack`; restored on exit, also on error. Blocks on several threads run
    one after the other (a lock; re-entrant on one thread)."""
    from tvm.tirx.script.parser import entry

    with _SWAP_LOCK:
        saved = entry.inspect
        entry.inspect = _InspectWithCheapStack()
        try:
            yield
        finally:
            entry.inspect = saved


def import_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (registers every target's tensor intrinsics)
    within :func:`cheap_tvmscript_stack`; idempotent, thread-safe."""
    with _LOCK:
        if "tvm.s_tir.tensor_intrin" in sys.modules:
            return
        with cheap_tvmscript_stack():
            import tvm.s_tir.tensor_intrin  # noqa: F401
