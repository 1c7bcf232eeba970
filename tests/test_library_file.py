"""``autoq.load_library`` checks the file first (issue 17, item 4; issue 38, item 6): a
truncated library raised SIGBUS inside dlopen (run in a subprocess here, so a crash fails
the test instead of killing pytest), a foreign shared object an attribute error, a flipped
byte without the stamp loaded and computed something else, another library under this
one's stamp loaded. Each is now a LibraryError naming the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import autoq
from autoq.errors import LibraryError
from autoq.ir.library_file import stamp_path
from models import TARGET, mlp


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    mod, params, data = mlp()
    r = autoq.Quantizer(autoq.Config(recipe="cnn"), target=TARGET).run(mod, params, data(4))
    path = autoq.export_library(r.module, tmp_path_factory.mktemp("lib") / "model.so", TARGET)
    return path, data(1)[0], r.module


def _load_in_subprocess(paths: list[Path]) -> subprocess.CompletedProcess:
    """Load each path in one fresh process; print each LibraryError (exit 3 if all raised)."""
    code = (
        "import sys, autoq\n"
        "n = 0\n"
        f"for p in {[str(p) for p in paths]!r}:\n"
        "    try:\n"
        "        autoq.load_library(p)\n"
        "    except autoq.errors.LibraryError as e:\n"
        "        print('LibraryError:', e); n += 1\n"
        f"sys.exit(3 if n == {len(paths)} else 0)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_exported_library_loads_and_runs(library):
    path, x, _ = library
    assert (path.parent / "model.so.autoq.json").is_file()
    out = autoq.load_library(path)["main"](autoq.build.tvm.runtime.tensor(x)).numpy()
    assert out.shape == (2, 4) and np.all(np.isfinite(out))


def test_truncated_library_is_an_error_not_sigbus(library, tmp_path):
    """Half of the library, with and without its stamp."""
    path, _, _ = library
    data = path.read_bytes()
    bad = []
    for stamp in (True, False):
        d = tmp_path / f"stamp_{stamp}"
        d.mkdir()
        (d / "model.so").write_bytes(data[: len(data) // 2])
        if stamp:
            shutil.copy(path.parent / "model.so.autoq.json", d)
        bad.append(d / "model.so")
    p = _load_in_subprocess(bad)
    assert p.returncode == 3, (p.returncode, p.stdout, p.stderr)  # -7 would be SIGBUS
    for b, line in zip(bad, p.stdout.strip().splitlines(), strict=True):
        assert str(b) in line and "truncated" in line, line


def _copy(path: Path, folder: Path, stamp: bool = True) -> Path:
    folder.mkdir(exist_ok=True)
    shutil.copy(path, folder / "model.so")
    if stamp:
        shutil.copy(stamp_path(path), folder)
    return folder / "model.so"


@pytest.mark.parametrize("stamp", [True, False])
def test_modified_library_is_refused_with_or_without_its_stamp(library, tmp_path, stamp):
    """One byte flipped in the code or data (issue 38, item 6: deleting the stamp used to
    turn the check off), or the integrity trailer cut off."""
    path, _, _ = library
    flipped = _copy(path, tmp_path / "flipped", stamp)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(LibraryError, match=r"model.so.*modified since export_library"):
        autoq.load_library(flipped)
    cut = _copy(path, tmp_path / "cut", stamp)
    cut.write_bytes(path.read_bytes()[:-10])  # the ELF part whole, the trailer's end gone
    with pytest.raises(LibraryError, match=r"model.so.*carries no autoq integrity data"):
        autoq.load_library(cut)


def test_library_without_its_stamp_is_refused(library, tmp_path):
    path, _, _ = library
    alone = _copy(path, tmp_path, stamp=False)
    with pytest.raises(LibraryError, match=r"model.so.*has no stamp model.so.autoq.json"):
        autoq.load_library(alone)


def test_another_library_with_this_stamp_is_refused(library, tmp_path):
    """Another valid export (the same model: same code, another id) under the first one's
    stamp (issue 38, item 6); each with its own stamp loads."""
    path, _, module = library
    other = autoq.export_library(module, tmp_path / "other" / "model.so", TARGET)
    autoq.load_library(other)
    swapped = _copy(other, tmp_path / "swapped", stamp=False)
    shutil.copy(stamp_path(path), tmp_path / "swapped")
    with pytest.raises(LibraryError, match=r"model.so.*stamp belongs to another library"):
        autoq.load_library(swapped)


def test_foreign_shared_object(tmp_path):
    """numpy's own extension module: a valid ELF shared object, not a model library."""
    shutil.copy(np._core._multiarray_umath.__file__, tmp_path / "foreign.so")
    with pytest.raises(LibraryError, match=r"foreign.so.*carries no autoq integrity data"):
        autoq.load_library(tmp_path / "foreign.so")


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "no library file"), (b"", "not a shared library"), (b"hello\n" * 20, "no ELF")],
)
def test_missing_empty_and_text_files(tmp_path, content, needle):
    path = tmp_path / "model.so"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(LibraryError, match=needle) as e:
        autoq.load_library(path)
    assert str(path) in str(e.value)
