"""The command's output folder: checked before any work, written in a temporary folder next
to it, swapped into place only when everything succeeded, and locked against a second run.

* **Checked first.** :class:`OutputDir` (a context manager) refuses, with
  :class:`autoq.errors.OutputError` (exit code 2), an ``--out`` that is a file, whose parent
  cannot be created or written, or that is a non-empty folder autoq did not write (no
  :data:`MARKER` file and not only autoq's file names) unless ``force``. It does so on entry,
  before the model is imported or calibrated.
* **Locked.** On entry it takes an exclusive ``flock`` on a lock file named by a hash of
  ``--out``'s resolved path, in ``<tmp>/autoq-locks`` (the file holds the owner's pid; no file
  is left in the user's folders); a second run on the same ``--out`` is refused
  at once, naming that pid, instead of interleaving its files with the first.
* **Atomic.** Results are written into ``.<name>.autoq-tmp-*`` next to ``--out`` (same file
  system). :meth:`OutputDir.commit` writes :data:`MARKER` and exchanges the two folders with
  one ``renameat2(RENAME_EXCHANGE)`` (Linux; elsewhere two renames), then deletes the old
  result. A kill at any moment leaves either the old complete result or the new complete
  one in ``--out``; a failure or Ctrl-C removes the temporary folder and leaves ``--out`` as
  it was. Temporary folders of runs killed with SIGKILL are removed by the next run on the
  same ``--out`` (under the lock, so no other run owns them).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from autoq.errors import OutputError

__all__ = ["MARKER", "OutputDir", "lock_path"]

#: written into every result folder; its presence makes the folder replaceable
MARKER = ".autoq-result"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class OutputDir:
    """``with OutputDir(out, force, known_files) as staging:`` write into ``staging.path``,
    then ``staging.commit()`` (see the module docstring). ``known_files``: the names autoq
    writes (a folder holding only those counts as an earlier result)."""

    def __init__(self, out: Path, force: bool = False, known_files=()):
        self.out = Path(out)
        self.force = force
        self.known = {MARKER, *known_files}
        self.path: Path | None = None
        self._lock_fd: int | None = None

    def __enter__(self) -> OutputDir:
        self._check_target()
        parent = self.out.absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._lock(parent)
            self._remove_stale(parent)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.autoq-tmp-", dir=parent))
        except OSError as e:
            self._unlock()
            raise OutputError(
                f"--out {str(self.out)!r} cannot be written ({e.strerror or e}): choose a "
                "folder you can write to"
            ) from None
        return self

    def __exit__(self, *exc) -> bool:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        self._unlock()
        return False

    def _check_target(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise OutputError(f"--out {str(out)!r} exists and is not a folder")
        if out.is_dir() and not self.force:
            entries = {p.name for p in out.iterdir()}
            if entries and MARKER not in entries and not entries <= self.known:
                shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
                raise OutputError(
                    f"--out {str(out)!r} is not empty and was not written by autoq ({shown}): "
                    "choose a new or empty folder, or pass --force to replace its contents"
                )

    def _lock(self, parent: Path) -> None:
        import fcntl

        fd = os.open(lock_path(parent / self.out.name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"--out {str(self.out)!r} is being written by another autoq run (pid {owner}): "
                "wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _remove_stale(self, parent: Path) -> None:
        """Temporary and old folders of earlier runs on this --out (we hold the lock)."""
        for pattern in (f".{self.out.name}.autoq-tmp-*", f".{self.out.name}.autoq-old-*"):
            for p in parent.glob(pattern):
                shutil.rmtree(p, ignore_errors=True)

    def commit(self, files: list[str]) -> None:
        """Make the staged folder ``--out`` (atomically where the OS allows)."""
        assert self.path is not None
        (self.path / MARKER).write_text(json.dumps({"files": files}) + "\n")
        staged, out = self.path, self.out
        if out.is_dir() and _exchange(staged, out):
            shutil.rmtree(staged, ignore_errors=True)  # now holds the old result
        else:
            if out.is_dir():
                old = staged.with_name(staged.name.replace("autoq-tmp", "autoq-old"))
                out.rename(old)
                staged.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                staged.rename(out)
        self.path = None


def lock_path(out: Path) -> Path:
    """The lock file of the output folder ``out``: in the temporary folder (never in the
    user's), named by a hash of the resolved path, kept (removing a lock file races)."""
    folder = Path(tempfile.gettempdir()) / "autoq-locks"
    folder.mkdir(exist_ok=True)
    key = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:20]
    return folder / f"{key}.lock"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where unsupported."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        return rc == 0
    return False
