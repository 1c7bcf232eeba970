"""Work folders autoq creates next to the user's files, named for the process that owns
them: ``<prefix><pid>-<random>``.

A run killed with SIGKILL cannot remove its folder; :func:`remove_dead_dirs` removes the
ones of ``prefix`` whose pid no longer runs. The prefix is compared as a string, never as a
glob (a user's ``--out 'r*'`` names ``.r*.autoq-tmp-`` only), and the rest of the name must
be ``<digits>-<letters or digits>`` (no dot), so the folders of ``--out r`` and ``--out
r.autoq-tmp-1`` cannot be confused. Only folders the running user owns are removed.

>>> import tempfile; parent = Path(tempfile.mkdtemp())
>>> mine = pid_dir(parent, ".res.autoq-tmp-")
>>> mine.name.startswith(f".res.autoq-tmp-{os.getpid()}-")
True
>>> (parent / ".res.autoq-tmp-999999999-dead").mkdir()   # no such pid
>>> (parent / ".r*.autoq-tmp-999999999-dead").mkdir()   # another --out's
>>> [p.name for p in remove_dead_dirs(parent, ".res.autoq-tmp-")]
['.res.autoq-tmp-999999999-dead']
>>> sorted(p.name.split("-")[0] for p in parent.iterdir())
['.r*.autoq', '.res.autoq']
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

__all__ = ["alive", "pid_dir", "remove_dead_dirs", "temp_folder"]

_OWNED = re.compile(r"(\d+)-[0-9a-z_]+")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_dir(parent: str | Path, prefix: str, mode: int = 0o777) -> Path:
    """Create and return ``parent/<prefix><pid>-<random>`` with ``mode`` minus the umask
    (as ``mkdir`` does: 0755 under umask 022 by default)."""
    for _ in range(100):
        path = Path(parent) / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path, mode)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name {prefix}{os.getpid()}-* in {str(parent)!r}")


def remove_dead_dirs(parent: str | Path, prefix: str) -> list[Path]:
    """Remove this user's folders ``parent/<prefix><pid>-<random>`` whose pid no longer
    runs; returns them (see the module docstring)."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        m = _OWNED.fullmatch(e.name[len(prefix) :]) if e.name.startswith(prefix) else None
        if m is None or not e.is_dir(follow_symlinks=False) or alive(int(m[1])):
            continue
        if e.stat(follow_symlinks=False).st_uid == os.getuid():
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(Path(e.path))
    return removed


@contextlib.contextmanager
def temp_folder(folder: Path):
    """``TMPDIR`` (the C compiler's temporary files) set to ``folder`` meanwhile."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
