"""The package's layout rules (docs/design.md): no module over 600 lines, no function over
80, no import cycle, no private name imported across modules. scripts/check_layout.py reads
the source with ast; this test runs it on the repository and on a planted violation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _checker():
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts/check_layout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_repository_keeps_its_layout_rules(capsys):
    assert _checker().main(ROOT) == 0, capsys.readouterr().out


def test_the_checker_catches_a_long_function_a_cycle_and_a_private_import(tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "pkg" = "pkg" }\n')
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    (pkg / "a.py").write_text(f"from .b import _hidden\n\n\ndef long():\n{body}\n")
    (pkg / "b.py").write_text("from . import a\n\n_hidden = 1\n")
    assert _checker().main(tmp_path) == 1
    out = capsys.readouterr().out
    assert "function over 80 lines: pkg/a.py:4 long" in out
    assert "import cycle: pkg.a <-> pkg.b" in out or "import cycle: pkg.b <-> pkg.a" in out
    assert "private name imported from another module: pkg/a.py:1 _hidden from pkg.b" in out


def _modules_in_design_doc() -> set[str]:
    import re

    text = (ROOT / "docs/design.md").read_text()
    table = text[text.index("## Layout") : text.index("## Conventions")]
    return set(re.findall(r"`((?:autoq|calibrators|patterns)/[\w/]+\.py)`", table))


def test_the_design_doc_lists_every_module_and_only_modules_that_exist():
    on_disk = {
        str(p.relative_to(ROOT))
        for folder in ("autoq", "calibrators", "patterns")
        for p in (ROOT / folder).rglob("*.py")
    }
    listed = _modules_in_design_doc()
    assert not on_disk - listed, f"modules missing from docs/design.md: {sorted(on_disk - listed)}"
    assert not listed - on_disk, f"docs/design.md lists missing modules: {sorted(listed - on_disk)}"
