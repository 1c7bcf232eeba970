"""``autoq.load_library`` checks the file first (issue 17, item 4): a truncated library
raised SIGBUS inside dlopen (run in a subprocess here, so a crash fails the test instead of
killing pytest), a foreign shared object an attribute error. Each is now a LibraryError
naming the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import autoq
from autoq.errors import LibraryError
from models import TARGET, mlp


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    mod, params, data = mlp()
    r = autoq.Quantizer(autoq.Config(recipe="cnn"), target=TARGET).run(mod, params, data(4))
    path = autoq.export_library(r.module, tmp_path_factory.mktemp("lib") / "model.so", TARGET)
    return path, data(1)[0]


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
    path, x = library
    assert (path.parent / "model.so.autoq.json").is_file()
    out = autoq.load_library(path)["main"](autoq.build.tvm.runtime.tensor(x)).numpy()
    assert out.shape == (2, 4) and np.all(np.isfinite(out))


def test_truncated_library_is_an_error_not_sigbus(library, tmp_path):
    """Half of the library, with and without its stamp."""
    path, _ = library
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


def test_modified_library_does_not_match_its_stamp(library, tmp_path):
    path, _ = library
    shutil.copy(path, tmp_path / "model.so")
    shutil.copy(path.parent / "model.so.autoq.json", tmp_path)
    data = bytearray((tmp_path / "model.so").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "model.so").write_bytes(bytes(data))
    with pytest.raises(LibraryError, match=r"model.so.*does not match its stamp"):
        autoq.load_library(tmp_path / "model.so")


def test_foreign_shared_object(tmp_path):
    """numpy's own extension module: a valid ELF shared object, not a model library."""
    shutil.copy(np._core._multiarray_umath.__file__, tmp_path / "foreign.so")
    with pytest.raises(LibraryError, match=r"foreign.so.*cannot be loaded as an autoq"):
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
