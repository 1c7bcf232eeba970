"""Per-sample values of graph tensors during calibration, in RAM up to a budget, then on disk.

Topological calibration keeps, for every sample, the tensors that later segments still need
(:mod:`autoq.calibration.shard_runner`). :class:`ValueCache` holds them as numpy arrays up to
``budget_bytes`` and spills the rest to ``.npy`` files in a fresh ``autoq-calib-<pid>-*``
folder inside ``cache_dir`` (or the temporary folder), removed on :meth:`ValueCache.close`
(calibration closes it in a ``finally``: an exception or Ctrl-C cleans up; the command line
turns SIGTERM into the same path). A process killed outright leaves its folder; the next
spill in the same parent removes folders whose pid no longer runs.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import tvm

from autoq.errors import InputError
from autoq.files import pid_dir, remove_dead_dirs

__all__ = [
    "ALIGN",
    "SPILL_PREFIX",
    "ValueCache",
    "aligned_copy",
    "as_tensor",
    "remove_stale_spill_dirs",
]

#: spill folders are ``autoq-calib-<pid>-<random>`` (in ``cache_dir`` or the temp folder)
SPILL_PREFIX = "autoq-calib-"


def remove_stale_spill_dirs(parent: Path) -> list[Path]:
    """Remove the spill folders in ``parent`` left by processes that no longer run (killed
    during calibration: SIGKILL, or SIGTERM outside the command line); returns them."""
    return remove_dead_dirs(parent, SPILL_PREFIX)


#: byte alignment of the cached arrays: TVM takes a numpy array as a tensor without a copy
#: (DLPack) only at this alignment
ALIGN = 64


def aligned_copy(value) -> np.ndarray:
    """A C-contiguous numpy copy of ``value`` (a VM tensor or an array) whose data starts
    at an :data:`ALIGN`-byte boundary."""
    if not hasattr(value, "numpy"):
        value = np.asarray(value)
    dtype = np.dtype(str(value.dtype))
    shape = tuple(int(d) for d in value.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + ALIGN, np.uint8)
    start = -buf.ctypes.data % ALIGN
    arr = buf[start : start + nbytes].view(dtype).reshape(shape)
    if isinstance(value, np.ndarray):
        np.copyto(arr, value)
    elif nbytes:
        value.copyto(tvm.runtime.from_dlpack(arr))
    return arr


def as_tensor(arr: np.ndarray):
    """``arr`` as a tvm tensor: the same memory when it is aligned, contiguous and writable
    (the VM only reads its inputs), else a copy."""
    aligned = arr.ctypes.data % ALIGN == 0 and arr.size
    if aligned and arr.flags.c_contiguous and arr.flags.writeable:
        return tvm.runtime.from_dlpack(arr)
    return tvm.runtime.tensor(arr)


class ValueCache:
    """Per-sample values of graph variables, in RAM up to a budget, then on disk.

    Values are kept as numpy copies: a tensor returned by the VM can keep a whole pooled
    storage block alive (measured: 3.8x the tensor's size on PP-OCRv4), so holding VM
    outputs would blow the budget it accounts for. The copies are aligned for TVM
    (:func:`aligned_copy`), so reading one back as a VM input copies nothing."""

    def __init__(self, budget_bytes: float, cache_dir: str | None = None):
        self.budget = budget_bytes
        self.ram: dict[tuple, object] = {}
        self.disk: dict[tuple, Path] = {}
        self.nbytes = 0
        self.peak = 0
        self.spilled = 0
        if cache_dir and Path(cache_dir).exists() and not Path(cache_dir).is_dir():
            raise InputError(
                f"cache_dir {str(cache_dir)!r} is a file, not a folder: give a folder "
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
            self._dir = pid_dir(parent, SPILL_PREFIX, 0o700)  # calibration data: private
            self._own_dir = True
        return self._dir / f"v{abs(hash(key))}_{len(self.disk)}.npy"

    def put(self, key, value) -> None:
        arr = aligned_copy(value)
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

    def __contains__(self, key) -> bool:
        return key in self.ram or key in self.disk

    def get(self, key):
        """The value as a tvm tensor (sharing the cached array's memory when it is in RAM:
        :func:`as_tensor`)."""
        return as_tensor(self.get_numpy(key))

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
