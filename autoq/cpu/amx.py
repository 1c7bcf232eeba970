"""Whether this process may run Intel AMX int8 tiles, and how a target gets the AMX features.

Two facts decide it, and neither is visible in LLVM's host CPU name:

- **The CPU has AMX** (``amx_tile`` and ``amx_int8`` in ``/proc/cpuinfo``). LLVM's host
  detection can report a CPU name without them (a virtualized Sapphire Rapids reports
  ``rocketlake``), so :func:`missing_amx_features` lists the AMX features the host has and
  the ``mcpu`` lacks; :func:`autoq.default_target` adds them as ``mattr`` (the ``mcpu``
  stays ``llvm_get_system_cpu()``; no CPU name is ever hard-coded).
- **Linux lets the process use the tile data state.** Before the first AMX instruction a
  process must ask for it once: ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``;
  without it the first tile instruction kills the process (SIGILL). The TVM wheel has no
  runtime hook for it, so :func:`request_amx` makes the system call with ctypes (once per
  process, cached) and :func:`require_amx` turns a refusal into a :class:`PlatformError`.

The default target only gets the AMX features when the request succeeds, so code compiled
for it never faults; a target given by the user with ``+amx-int8`` is checked by
:func:`autoq.compile`.
"""

from __future__ import annotations

import tvm

from autoq.errors import PlatformError
from autoq.ir.target import (
    AMX_FEATURES,
    cpu_flags,
    host_target_features,
    missing_amx_features,
    request_amx,
    target_has_amx,
)

__all__ = [
    "AMX_FEATURES",
    "cpu_flags",
    "host_target_features",
    "missing_amx_features",
    "request_amx",
    "require_amx",
    "target_has_amx",
]


def require_amx(target: tvm.target.Target) -> None:
    """Make sure code compiled for ``target`` can run in this process: a target with the
    AMX features needs the tile data state, a refusal is a :class:`PlatformError`."""
    if not target_has_amx(target):
        return
    why = request_amx()
    if why is not None:
        raise PlatformError(
            f"target {target} uses AMX tiles (+amx-tile/+amx-int8) but this process cannot: "
            f"{why}. Compile for a target without them (drop them from 'mattr', or use an "
            "'mcpu' without AMX), or run on a Linux >= 5.16 kernel on an AMX CPU."
        )
