"""Per-sample values of graph tensors during calibration, in RAM up to a budget, then on disk.

Topological calibration keeps, for every sample, the tensors that later segments still need
(:mod:`autoq.shard_runner`). :class:`ValueCache` holds them as numpy arrays up to
``budget_bytes`` and spills the rest to ``.npy`` files in a fresh ``autoq-calib-<pid>-*``
folder inside ``cache_dir`` (or the temporary folder), removed on :meth:`ValueCache.close`
(calibration closes it in a ``finally``: an exception or Ctrl-C cleans up; the command line
turns SIGTERM into the same path). A process killed outright leaves its folder; the next
spill in the same parent removes folders whose pid no longer runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tvm

from .errors import InputError

__all__ = ["SPILL_PREFIX", "ValueCache", "remove_stale_spill_dirs"]

#: spill folders are ``autoq-calib-<pid>-<random>`` (in ``cache_dir`` or the temp folder)
SPILL_PREFIX = "autoq-calib-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_spill_dirs(parent: Path) -> list[Path]:
    """Remove the spill folders in ``parent`` left by processes that no longer run (killed
    during calibration: SIGKILL, or SIGTERM outside the command line); returns them."""
    removed = []
    for d in parent.glob(f"{SPILL_PREFIX}*"):
        pid = d.name[len(SPILL_PREFIX) :].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class ValueCache:
    """Per-sample values of graph variables, in RAM up to a budget, then on disk.

    Values are kept as numpy copies: a tensor returned by the VM can keep a whole pooled
    storage block alive (measured: 3.8x the tensor's size on PP-OCRv4), so holding VM
    outputs would blow the budget it accounts for."""

    def __init__(self, budget_bytes: float, cache_dir: str | None = None):
        self.budget = budget_bytes
        self.ram: dict[tuple, object] = {}
        self.disk: dict[tuple, Path] = {}
        self.nbytes = 0
        self.peak = 0
        self.spilled = 0
        if cache_dir and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
            raise InputError(
                f"Config.cache_dir {str(cache_dir)!r} is a file, not a folder: give a folder "
                "(created if missing) or None for a temporary one"
            )
        self._dir_arg = cache_dir
        self._dir: Path | None = None
        self._own_dir = False

    def _path(self, key) -> Path:
        if self._dir is None:
            parent = Path(self._dir_arg) if self._dir_arg else Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            remove_stale_spill_dirs(parent)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-", dir=parent))
            self._own_dir = True
        return self._dir / f"v{abs(hash(key))}_{len(self.disk)}.npy"

    def put(self, key, value) -> None:
        arr = value.numpy() if hasattr(value, "numpy") else np.ascontiguousarray(value)
        nb = arr.nbytes
        if self.nbytes + nb <= self.budget:
            self.ram[key] = (arr, nb)
            self.nbytes += nb
            self.peak = max(self.peak, self.nbytes)
        else:
            p = self._path(key)
            np.save(p, arr)
            self.disk[key] = p
            self.spilled += nb

    def get(self, key):
        """The value as a tvm tensor (a fresh copy)."""
        return tvm.runtime.tensor(self.get_numpy(key))

    def get_numpy(self, key) -> np.ndarray:
        if key in self.ram:
            return self.ram[key][0]
        return np.load(self.disk[key], mmap_mode="r")

    def drop(self, key) -> None:
        if key in self.ram:
            self.nbytes -= self.ram.pop(key)[1]
        elif key in self.disk:
            self.disk.pop(key).unlink(missing_ok=True)

    def close(self) -> None:
        for p in self.disk.values():
            p.unlink(missing_ok=True)
        self.ram.clear()
        self.disk.clear()
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
