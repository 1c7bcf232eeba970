"""The compiled library file checked before it is loaded.

``dlopen`` of a truncated shared library maps pages past the end of the file and the process
dies with SIGBUS on first touch; a foreign ``.so`` loads and then fails with an attribute
error; a library with a flipped byte may load and compute something else. So
:func:`write_stamp` (called by :func:`autoq.export_library`) binds the library to its stamp:

* a random id and the SHA-256 of the library are appended to the library itself (a trailer
  after the ELF data, which the loader ignores): ``AUTOQ`` + JSON + 8-byte length +
  ``AUTOQLIB``;
* ``<library>.autoq.json`` next to it holds the same id, the final size and the SHA-256 of
  the whole file.

:func:`check_library` refuses, with :class:`autoq.errors.LibraryError` naming the file: a
missing file; one that is not an ELF shared object; one whose ELF headers point past its
end (truncated); one without the trailer (not written by ``export_library``, or cut); one
whose content does not match its trailer (modified); a missing stamp (integrity cannot be
checked without it); a stamp of another library (another id: a library replaced by another
autoq library, or a stamp copied from elsewhere); a stamp whose size or SHA-256 differ.

The stamp also records the signature of the library's ``main`` (``inputs`` and ``outputs``:
name, shape, dtype each), which :func:`autoq.load` checks calls against
(:func:`read_signature`).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from pathlib import Path

from autoq.errors import LibraryError
from autoq.json_document import write_atomic

__all__ = ["check_library", "read_signature", "stamp_path", "write_stamp"]

_ELF_MAGIC = b"\x7fELF"
_TRAILER_MAGIC = b"AUTOQLIB"
_TRAILER_START = b"AUTOQ"
_FORMAT = "autoq.library"


def stamp_path(library: Path) -> Path:
    return library.with_name(library.name + ".autoq.json")


def _hash(path: Path, size: int):
    """SHA-256 of the first ``size`` bytes of ``path`` (a hashlib object)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while size > 0:
            block = f.read(min(size, 1 << 20))
            if not block:
                break
            h.update(block)
            size -= len(block)
    return h


def write_stamp(library: Path, signature: dict | None = None) -> Path:
    """Append the trailer (id, SHA-256) to ``library`` and write ``<library>.autoq.json``
    (id, size, SHA-256 of the whole file and the ``signature`` ``{"inputs": [...],
    "outputs": [...]}``, if given) next to it; returns the stamp's path."""
    library = Path(library)
    lib_id = secrets.token_hex(16)
    h = _hash(library, library.stat().st_size)
    body = json.dumps({"format": _FORMAT, "id": lib_id, "sha256": h.hexdigest()}).encode()
    trailer = _TRAILER_START + body + struct.pack("<Q", len(body)) + _TRAILER_MAGIC
    with open(library, "ab") as f:
        f.write(trailer)
    h.update(trailer)
    doc = {"format": _FORMAT, "id": lib_id, "size": library.stat().st_size, "sha256": h.hexdigest()}
    doc.update(signature or {})
    return write_atomic(stamp_path(library), json.dumps(doc, indent=1) + "\n")


def _trailer(path: Path, size: int) -> tuple[dict, int] | None:
    """(trailer document, size of the library before it), None without a valid trailer."""
    tail = len(_TRAILER_START) + 8 + len(_TRAILER_MAGIC)
    if size < tail:
        return None
    with open(path, "rb") as f:
        f.seek(size - 16)
        end = f.read(16)
        if end[8:] != _TRAILER_MAGIC:
            return None
        n = struct.unpack("<Q", end[:8])[0]
        start = size - 16 - n - len(_TRAILER_START)
        if n > 1 << 16 or start < 0:
            return None
        f.seek(start)
        raw = f.read(n + len(_TRAILER_START))
    try:
        doc = json.loads(raw[len(_TRAILER_START) :]) if raw.startswith(_TRAILER_START) else None
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        return None
    return doc, start


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
    """``path`` if it is a complete library written by ``export_library`` with its stamp
    (see the module docstring)."""
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
    found = _trailer(path, size)
    if found is None:
        raise LibraryError(
            f"{str(path)!r} carries no autoq integrity data (not written by "
            "autoq.export_library, or cut since): export it with autoq.export_library"
        )
    mark, body_size = found
    h = _hash(path, body_size)
    if h.hexdigest() != mark.get("sha256"):
        raise LibraryError(
            f"{str(path)!r} was modified since export_library (its content does not match "
            "the SHA-256 it carries): export it again"
        )
    stamp = stamp_path(path)
    if not stamp.is_file():
        raise LibraryError(
            f"{str(path)!r} has no stamp {stamp.name} next to it (it cannot be checked "
            "without it): copy the stamp along with the library, or export it again"
        )
    try:
        doc = json.loads(stamp.read_text())
        want_id, want_size, want_sha = str(doc["id"]), int(doc["size"]), str(doc["sha256"])
    except (ValueError, KeyError, TypeError):
        raise LibraryError(f"{str(stamp)!r} is not a valid autoq library stamp") from None
    if want_id != mark.get("id"):
        raise LibraryError(
            f"{str(path)!r} does not match its stamp {stamp.name}: the stamp belongs to "
            f"another library (id {want_id[:8]}, this library's {str(mark.get('id'))[:8]}); "
            "copy the library and its stamp together, or export it again"
        )
    with open(path, "rb") as f:
        f.seek(body_size)
        h.update(f.read())
    if size != want_size or h.hexdigest() != want_sha:
        raise LibraryError(
            f"{str(path)!r} does not match its stamp {stamp.name} ({size} bytes, exported "
            f"{want_size}): truncated or replaced since export_library; export it again"
        )
    return path
