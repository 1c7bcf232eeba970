"""The command's output folder: checked before any work, written in a temporary folder next
to it, swapped into place only when everything succeeded, and locked against a second run.

* **Checked first.** :class:`OutputDir` (a context manager) refuses, with
  :class:`autoq.errors.OutputError` (exit code 2), before the model is imported: an
  ``--out`` name that is not UTF-8; a symbolic link to nothing; the current folder or one
  holding it (it is replaced whole); a file; a folder whose parent cannot be created or
  written; a non-empty folder without autoq's :data:`MARKER` (whatever its file names)
  unless ``force`` — then :attr:`OutputDir.removed` lists what the swap removed.
  A symbolic link to a folder is followed: the result replaces the folder it points to and
  the link stays.
* **Locked.** On entry it takes an exclusive ``flock`` on ``.<name>.autoq-lock`` next to
  the folder (opened without following symbolic links; refused unless it is a regular file
  of the running user with one link; it holds the owner's pid and is removed at the end).
  A second run on the same folder, whatever its ``TMPDIR`` or the path it was named by, is
  refused at once, naming that pid, instead of interleaving its files with the first.
* **Atomic.** Results are written into ``.<name>.autoq-tmp-<pid>-<random>`` next to the
  folder (same file system; modes follow the umask). :meth:`OutputDir.commit` writes
  :data:`MARKER` and exchanges the two folders with one ``renameat2(RENAME_EXCHANGE)``
  (Linux; elsewhere two renames), then deletes the old result. A kill at any moment leaves
  either the old complete result or the new complete one; a failure or Ctrl-C removes the
  temporary folder and leaves ``--out`` as it was. A full disk while writing is an
  :class:`OutputError` saying so (``--out`` unchanged). Temporary folders of runs killed
  with SIGKILL are removed by the next run on the same folder: only folders of exactly that
  name whose pid no longer runs (:func:`autoq.files.remove_dead_dirs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from autoq.errors import AutoqError, OutputError
from autoq.files import pid_dir, remove_dead_dirs

__all__ = ["MARKER", "FolderLock", "OutputDir"]

#: written into every result folder; its presence makes the folder replaceable
MARKER = ".autoq-result"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: less free space than this after a failed write: the disk was full
_FULL_BYTES = 1 << 20


class OutputDir:
    """``with OutputDir(out, force) as staging:`` write into ``staging.path``, then
    ``staging.commit(files)`` (see the module docstring)."""

    def __init__(self, out: str | Path, force: bool = False):
        self.out = Path(out)
        self.force = force
        self.path: Path | None = None
        #: entries of a folder autoq did not write that the commit removes (``force``)
        self.removed: list[str] = []
        #: the folder the result replaces (``out`` with symbolic links followed; on entry)
        self.target: Path | None = None
        self._shown = repr(str(out))
        self._lock: FolderLock | None = None

    # ------------------------------------------------------------------ entry, exit

    def __enter__(self) -> OutputDir:
        target = self._resolve()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._lock = FolderLock(
                target, f"--out {self._shown}", "wait for it to finish or choose another --out"
            ).acquire()
        except OSError as e:
            if isinstance(e, AutoqError):
                raise
            raise self._unwritable(e) from None
        try:
            self._check_target(target)
            remove_dead_dirs(target.parent, self._prefix("tmp"))
            remove_dead_dirs(target.parent, self._prefix("old"))
            self.path = pid_dir(target.parent, self._prefix("tmp"))
        except BaseException as e:
            self._release()
            if isinstance(e, OSError) and not isinstance(e, AutoqError):
                raise self._unwritable(e) from None
            raise
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        try:
            full = self.path is not None and _disk_full(exc, self.path)
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
                self.path = None
        finally:
            self._release()
        if full:
            why = f" ({exc.strerror})" if isinstance(exc, OSError) and exc.strerror else ""
            raise OutputError(
                f"no space left on the device of --out {self._shown} while writing the "
                f"result{why}: free some space or choose another --out (--out is unchanged)"
            ) from None
        return False

    def _resolve(self) -> Path:
        """The folder to replace (a symbolic link followed), or an OutputError."""
        out, shown = self.out, self._shown
        try:
            os.fsencode(out).decode("utf-8")
        except UnicodeDecodeError:
            raise OutputError(
                f"--out {shown} is not a UTF-8 file name: choose a name in UTF-8"
            ) from None
        if out.is_symlink() and not out.exists():
            raise OutputError(
                f"--out {shown} is a symbolic link to {os.readlink(out)!r}, which does not "
                "exist: create that folder, remove the link or choose another --out"
            )
        target = Path(os.path.realpath(out))
        try:
            cwd = Path.cwd().resolve()
        except OSError:  # the current folder is gone
            cwd = None
        if cwd is not None and (target == cwd or target in cwd.parents):
            what = "the current folder" if target == cwd else "a folder holding the current one"
            raise OutputError(
                f"--out {shown} is {what}; --out is replaced as a whole: name a folder "
                "inside it, e.g. --out ./model_int8"
            )
        self.target = target
        return target

    def _check_target(self, target: Path) -> None:
        if target.exists() and not target.is_dir():
            raise OutputError(f"--out {self._shown} exists and is not a folder")
        if not target.is_dir():
            return
        entries = sorted(os.listdir(target))
        if entries and MARKER not in entries:
            if not self.force:
                shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
                raise OutputError(
                    f"--out {self._shown} is not empty and was not written by autoq "
                    f"({shown}): choose a new or empty folder, or pass --force to replace "
                    "its contents"
                )
            self.removed = entries

    def _prefix(self, kind: str) -> str:
        assert self.target is not None
        return f".{self.target.name}.autoq-{kind}-"

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _unwritable(self, e: OSError) -> OutputError:
        where = f": {e.filename!r}" if e.filename else ""
        return OutputError(
            f"--out {self._shown} cannot be written ({e.strerror or e}{where}): choose a "
            "folder you can write to"
        )

    # ------------------------------------------------------------------ commit

    def commit(self, files: list[str]) -> None:
        """Make the staged folder ``--out`` (atomically where the OS allows)."""
        assert self.path is not None and self.target is not None
        (self.path / MARKER).write_text(json.dumps({"files": files}) + "\n")
        staged, out = self.path, self.target
        if out.is_dir() and _exchange(staged, out):
            shutil.rmtree(staged, ignore_errors=True)  # now holds the old result
        elif out.is_dir():
            old = pid_dir(out.parent, self._prefix("old"))
            out.rename(old / "result")
            staged.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staged.rename(out)
        self.path = None


class FolderLock:
    """The exclusive lock of a result folder: ``flock`` on ``.<name>.autoq-lock`` next to
    ``target`` (module docstring). ``shown`` names the folder in messages (e.g.
    ``--out 'res'``), ``busy`` is the advice when another run holds it. Taken by :class:`OutputDir` and by ``autoq tune`` while it rebuilds a
    folder's library."""

    def __init__(self, target: Path, shown: str, busy: str = "wait for it to finish"):
        self.target, self.shown, self.busy = Path(target), shown, busy
        self.file = self.target.parent / f".{self.target.name}.autoq-lock"
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, kind, exc, tb) -> bool:
        self.release()
        return False

    def acquire(self) -> FolderLock:
        """Take the lock or raise :class:`OutputError` (held by another run: its pid;
        a lock file autoq did not make)."""
        import fcntl

        lock, shown = self.file, self.shown
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            try:
                fd = os.open(lock, flags, 0o666)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise OutputError(
                    f"the lock file {str(lock)!r} of {shown} is a symbolic link "
                    "(not made by autoq): remove it"
                ) from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
                os.close(fd)
                raise OutputError(
                    f"the lock file {str(lock)!r} of {shown} was not made by "
                    f"this user's autoq (owner uid {st.st_uid}, {st.st_nlink} links): "
                    "remove it"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise OutputError(
                    f"{shown} is being written by another autoq run (pid {owner}): {self.busy}"
                ) from None
            if _same_file(lock, st):  # not removed by the run that held it meanwhile
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            if _same_file(self.file, os.fstat(self._fd)):
                with contextlib.suppress(OSError):  # before the flock is released: a
                    self.file.unlink()  # run waiting on this file then retries on a new one
            os.close(self._fd)
            self._fd = None


def _same_file(path: Path, st: os.stat_result) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _disk_full(exc: BaseException | None, folder: Path) -> bool:
    """Whether the exception ``exc`` (raised while writing into ``folder``) came from a
    full disk: ENOSPC / EDQUOT, or (a compiler's or TVM's error) hardly any space left."""
    if exc is None or isinstance(exc, AutoqError | KeyboardInterrupt):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(exc, Exception):
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_BYTES


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where unsupported."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        return rc == 0
    return False
