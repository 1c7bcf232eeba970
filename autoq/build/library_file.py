"""The compiled library file checked before it is loaded.

``dlopen`` of a truncated shared library maps pages past the end of the file and the process
dies with SIGBUS on first touch; a foreign ``.so`` loads and then fails with an attribute
error. :func:`write_stamp` (called by :func:`autoq.export_library`) writes
``<library>.autoq.json`` next to the library: its size and SHA-256. :func:`check_library`
refuses, with :class:`autoq.errors.LibraryError` naming the file, a missing file, one that is
not an ELF shared object, one whose ELF headers point past its end (truncated), or one whose
stamp does not match (truncated or replaced since the export). A library without a stamp
(exported by plain TVM) is checked structurally only.

The stamp also records the signature of the library's ``main`` (``inputs`` and ``outputs``:
name, shape, dtype each), which :func:`autoq.load` checks calls against
(:func:`read_signature`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from autoq.errors import LibraryError
from autoq.json_document import write_atomic

__all__ = ["check_library", "read_signature", "stamp_path", "write_stamp"]

_ELF_MAGIC = b"\x7fELF"


def stamp_path(library: Path) -> Path:
    return library.with_name(library.name + ".autoq.json")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_stamp(library: Path, signature: dict | None = None) -> Path:
    """Write ``<library>.autoq.json`` (format, size, sha256 and the ``signature``
    ``{"inputs": [...], "outputs": [...]}``, if given) next to ``library``."""
    library = Path(library)
    doc = {"format": "autoq.library", "size": library.stat().st_size, "sha256": _digest(library)}
    doc.update(signature or {})
    return write_atomic(stamp_path(library), json.dumps(doc, indent=1) + "\n")


def read_signature(library: str | Path) -> dict | None:
    """``{"inputs": [...], "outputs": [...]}`` (each ``{"name", "shape", "dtype"}``) recorded
    by :func:`write_stamp` for ``library``; None when the stamp has none (an older export)."""
    stamp = stamp_path(Path(library))
    try:
        doc = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        return None
    return {"inputs": doc["inputs"], "outputs": doc.get("outputs") or []}


def _elf_extent(head: bytes) -> int:
    """The file size the ELF header says is needed (section and program header tables);
    raises ValueError when the header itself is not a 64- or 32-bit ELF header."""
    if head[:4] != _ELF_MAGIC or len(head) < 52:
        raise ValueError("not an ELF file")
    bits, order = head[4], "<" if head[5] == 1 else ">"
    if bits == 2 and len(head) >= 64:
        phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
    elif bits == 1:
        phoff, shoff = struct.unpack_from(order + "II", head, 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
    else:
        raise ValueError("unknown ELF class")
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def check_library(path: str | Path) -> Path:
    """``path`` if it looks like a complete shared library (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise LibraryError(f"no library file at {str(path)!r} (write one with export_library)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    try:
        extent = _elf_extent(head)
    except ValueError:
        raise LibraryError(
            f"{str(path)!r} is not a shared library (no ELF header; {size} bytes): "
            "load a file written by autoq.export_library"
        ) from None
    if extent > size:
        raise LibraryError(
            f"{str(path)!r} is truncated ({size} bytes, its ELF headers need {extent}): "
            "export it again"
        )
    stamp = stamp_path(path)
    if stamp.is_file():
        try:
            doc = json.loads(stamp.read_text())
            want_size, want_sha = int(doc["size"]), str(doc["sha256"])
        except (ValueError, KeyError, TypeError):
            raise LibraryError(f"{str(stamp)!r} is not a valid autoq library stamp") from None
        if size != want_size or _digest(path) != want_sha:
            raise LibraryError(
                f"{str(path)!r} does not match its stamp {stamp.name} ({size} bytes, exported "
                f"{want_size}): truncated or replaced since export_library; export it again"
            )
    return path
