"""The compile cache: every library autoq compiles, kept on disk by what it was compiled
from, so that quantizing the same model again (or ``autoq quantize`` after the same
``autoq.quantize`` call) compiles nothing again.

An entry is ``<folder>/<key>.so`` with its stamp ``<key>.so.autoq.json`` (size and SHA-256,
:mod:`autoq.ir.library_file`). The key is the SHA-256 of

* ``tvm_ffi.structural_hash`` of the module handed to ``tvm.compile`` (its functions,
  constants and attributes),
* the target (``str(target)``: the CPU and its features), the kind of compile (the Relax
  pipeline's name, or the options of :func:`autoq.build.compile`),
* the TVM version and a digest of autoq's own source files (a changed kernel or pass never
  reuses an old library).

The folder: ``$AUTOQ_COMPILE_CACHE`` if set (``off`` turns the cache off), else
``$XDG_CACHE_HOME/autoq/compiled`` (default ``~/.cache/autoq/compiled``). Entries are
written atomically (a temporary file renamed into place once complete); an entry whose
stamp does not match, that is not a complete shared library or that does not load is
deleted and compiled again. Beyond :data:`LIMIT_BYTES` the least recently used entries are
deleted. Clearing the cache is deleting the folder. A folder that cannot be written (read
only, disk full) only costs the reuse: the compile is used directly.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import tvm
import tvm_ffi

from autoq.errors import LibraryError
from autoq.files import pid_dir, remove_dead_dirs, temp_folder
from autoq.ir.library_file import check_library, stamp_path, write_stamp

__all__ = [
    "ENV",
    "LIMIT_BYTES",
    "SPARE_BYTES",
    "cache_folder",
    "cache_key",
    "cached_library",
    "cached_module",
    "counts",
    "forget",
]

#: the environment variable naming the folder (``off``: no cache)
ENV = "AUTOQ_COMPILE_CACHE"
#: the folder's size beyond which the least recently used entries are deleted
LIMIT_BYTES = 4 * 2**30
#: free space a store needs besides twice the constants (object file and library)
SPARE_BYTES = 16 << 20

_OFF = ("off", "0", "no", "false", "none")
#: this process's hits (a library loaded from the cache) and misses (compiled and stored)
_COUNTS = {"hits": 0, "misses": 0}


def counts() -> dict[str, int]:
    """``{"hits": n, "misses": m}`` of this process so far (a copy)."""
    return dict(_COUNTS)


def cache_folder() -> Path | None:
    """The cache folder (see the module docstring), or None when the cache is off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autoq" / "compiled"


@functools.cache
def _source_digest() -> str:
    """SHA-256 of autoq's Python sources (relative path and bytes, sorted by path)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(mod: tvm.IRModule, target, kind: str) -> str:
    """The entry name of ``mod`` compiled for ``target`` by the compile named ``kind``."""
    parts = (
        f"module={tvm_ffi.structural_hash(mod)}",
        f"target={tvm.target.Target(target) if isinstance(target, dict | str) else target}",
        f"kind={kind}",
        f"tvm={tvm.__version__}",
        f"autoq={_source_digest()}",
    )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def cached_library(
    mod: tvm.IRModule,
    target,
    kind: str,
    build: Callable[[], object],
    space: int = 0,
    key: str | None = None,
) -> tuple[Path | None, object]:
    """``(path, None)``: the cached library of ``mod`` (compiled now by ``build()``, a
    ``tvm.compile`` result, and stored when it was not cached); ``(None, executable)`` when
    the cache is off or cannot be written: fewer than ``space`` bytes (the library's
    constants, twice) plus :data:`SPARE_BYTES` free (LLVM ends the process when it cannot
    write an object file), or the export fails. ``key``: :func:`cache_key` of the three, if
    the caller has it (hashing a large module takes a while)."""
    folder = cache_folder()
    if folder is None:
        return None, build()
    path = folder / f"{key or cache_key(mod, target, kind)}.so"
    if _usable(path):
        _COUNTS["hits"] += 1
        return path, None
    executable = build()
    try:
        st = os.statvfs(_existing(folder))
        if st.f_bavail * st.f_frsize < space + SPARE_BYTES:
            return None, executable
        _store(executable, path)
    except Exception:  # a read-only folder, a failed link: the compile is still good
        return None, executable
    _COUNTS["misses"] += 1
    _evict(folder, keep=path)
    return path, None


def cached_module(
    mod: tvm.IRModule, target, kind: str, build: Callable[[], object], space: int = 0
):
    """A runtime module of ``mod`` to run here: the cached library loaded, or ``build()``'s
    executable (compiled now, stored in the cache first when it is on). An entry that does
    not load (a damaged file whose stamp matches) is deleted and compiled again. Without a
    usable cache folder the module compiled last in this process is still reused when the
    same one is asked for again (the guard's, then calibration's)."""
    key = cache_key(mod, target, kind)
    if key in _LOADED:
        _COUNTS["hits"] += 1
        return _LOADED[key]
    path, executable = cached_library(mod, target, kind, build, space, key)
    if path is not None:
        try:
            return _load_quietly(path)
        except Exception:  # (dlopen errors, a library without a Relax executable)
            forget(path)
            path, executable = cached_library(mod, target, kind, build, space, key)
            if path is not None:
                return _load_quietly(path)
    module = executable.jit()
    _LOADED.clear()
    _LOADED[key] = module
    return module


#: without a cache folder: key -> the runtime module compiled last in this process
_LOADED: dict[str, object] = {}


#: what TVM FFI prints on standard error for every library loaded after the first one (each
#: library registers its embedded module under one global name; it reads its own: harmless)
_LOAD_NOTICE = "Warning:SystemLib symbol"


def _load_quietly(path: Path):
    """``tvm.runtime.load_module(path)`` without :data:`_LOAD_NOTICE` on standard error
    (whatever else is written meanwhile is written after the load)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            return tvm.runtime.load_module(str(path))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            rest = "".join(x for x in lines if not x.startswith(_LOAD_NOTICE))
            if rest:
                os.write(2, rest.encode())


def forget(path: Path) -> None:
    """Delete a cache entry and its stamp."""
    for p in (path, stamp_path(path)):
        p.unlink(missing_ok=True)


def _existing(folder: Path) -> Path:
    """``folder`` or its closest existing parent (where its free space is counted)."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _usable(path: Path) -> bool:
    """Whether ``path`` is a complete entry (matching its stamp); a damaged one is deleted."""
    if not path.is_file():
        return False
    if not stamp_path(path).is_file():  # (written after the library: an interrupted store)
        forget(path)
        return False
    try:
        check_library(path)
    except LibraryError:
        forget(path)
        return False
    os.utime(path)  # recently used
    return True


#: the work folders of stores (``<prefix><pid>-<random>``, :mod:`autoq.files`)
_WORK = ".autoq-store-"


def _store(executable, path: Path) -> None:
    """Export ``executable``'s library and its stamp in a work folder of this process next
    to ``path`` (TVM's object files and, through ``TMPDIR``, the compiler's temporary files
    there too), then move the stamp, then the library into place: a reader never finds a
    library without its stamp, except after an interrupted move (it is compiled again).
    Work folders of processes that died are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_dirs(path.parent, _WORK)
    work = pid_dir(path.parent, _WORK, 0o700)
    try:
        lib = work / path.name
        with temp_folder(work):
            executable.export_library(str(lib), workspace_dir=str(work))
        os.replace(write_stamp(lib), stamp_path(path))
        os.replace(lib, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _evict(folder: Path, keep: Path) -> None:
    """Delete the least recently used entries while the folder holds more than
    :data:`LIMIT_BYTES` (never ``keep``)."""
    try:
        entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in folder.glob("[!.]*.so")]
    except OSError:  # (another process deleted one meanwhile)
        return
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total <= LIMIT_BYTES:
            break
        if p != keep:
            forget(p)
            total -= size
